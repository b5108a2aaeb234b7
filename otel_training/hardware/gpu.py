"""GPU samples through NVML (``import pynvml``, from nvidia-ml-py).

Per GPU (sampled by the per-host lock holder only): utilization and memory-controller
utilization from NVML's buffered samples (every sample since the last one seen, so an
export interval's average covers the whole interval, not one instant), memory, SM
clock, power, temperature, throttle reasons and PCIe throughput. Per process (every
process, for itself): GPU memory and SM utilization.

A call that a model does not support removes only its gauges (one log line); no
driver or no GPU removes all GPU gauges. Nothing here raises. The per-GPU state and
NVML's error kinds and sample values are in ``nvml.py``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from otel_training.hardware import names as n
from otel_training.hardware.nvml import Gpu, as_text, describe, permanent_error, sample_value
from otel_training.hardware.stats import Store

_logger = logging.getLogger("otel_training.hardware")

# Clock throttle ("clocks event") reason bits: nvmlClocksThrottleReason* in nvml.h.
THROTTLE_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)

# metric key -> the gauges it feeds (removed together when the key is unsupported)
_GAUGES = {
    "utilization": (n.GPU_UTILIZATION,),
    "memory_controller": (n.GPU_MEMORY_CONTROLLER_UTILIZATION,),
    "memory": (n.GPU_MEMORY_USAGE, n.GPU_MEMORY_FREE, n.GPU_MEMORY_LIMIT),
    "clock": (n.GPU_CLOCK_SM,),
    "power": (n.GPU_POWER_DRAW,),
    "temperature": (n.GPU_TEMPERATURE,),
    "throttle": (n.GPU_THROTTLE,),
    "pcie": (n.GPU_PCIE_THROUGHPUT,),
    "process_memory": (n.PROCESS_GPU_MEMORY_USAGE,),
    "process_utilization": (n.PROCESS_GPU_UTILIZATION,),
}

# A per-process utilization older than this is dropped rather than repeated: NVML
# stops reporting samples for a process that stopped using the GPU.
PROCESS_UTILIZATION_STALE_S = 10.0

# PCIe throughput is reported in KB/s (1024 bytes).
_KIB = 1024


class GpuSource:
    """``start()`` loads NVML (call it on the sampler thread: nvmlInit can be slow)."""

    def __init__(self, store: Store, host_name: str, pid: int | None = None) -> None:
        self._store = store
        self._host_name = host_name
        self._pid = os.getpid() if pid is None else pid
        self._nvml: Any = None  # the pynvml module, once NVML is up
        self.gpus: list[Gpu] = []
        self._logged: set[str] = set()

    @property
    def available(self) -> bool:
        return bool(self.gpus)

    def start(self) -> bool:
        try:
            import pynvml
        except ImportError:
            _logger.info("no GPU metrics: nvidia-ml-py (pynvml) is not installed")
            return False
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded...
            _logger.info("no GPU metrics: NVML unavailable (%s)", describe(exc))
            return False
        self._nvml = pynvml
        try:
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:
            _logger.info("no GPU metrics: cannot count GPUs (%s)", describe(exc))
            count = -1
        for i in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = as_text(pynvml.nvmlDeviceGetUUID(handle))
                model = as_text(pynvml.nvmlDeviceGetName(handle))
            except Exception as exc:  # a lost or inaccessible GPU: skip it
                _logger.info("no metrics for GPU %d (%s)", i, describe(exc))
                continue
            self.gpus.append(Gpu(handle, i, uuid, model, self._host_name, self._pid))
        if not self.gpus:
            if count == 0:
                _logger.info("no GPU metrics: NVML found no GPU")
            self.close()
            return False
        return True

    def close(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass

    def reset(self) -> None:
        """Restart buffered-sample cursors (when this process becomes the sampler)."""
        for gpu in self.gpus:
            gpu.last_seen.pop("utilization", None)
            gpu.last_seen.pop("memory_controller", None)

    # --- per GPU (lock holder) ---------------------------------------------------------
    def sample_devices(self) -> None:
        nvml = self._nvml
        if nvml is None:
            return
        store = self._store
        for gpu in self.gpus:
            self._utilization(gpu)
            mem = self._call(gpu, "memory", nvml.nvmlDeviceGetMemoryInfo, gpu.handle)
            if mem is not None:
                store.add(n.GPU_MEMORY_USAGE, gpu.attrs, mem.used)
                store.add(n.GPU_MEMORY_FREE, gpu.attrs, mem.free)
                store.add(n.GPU_MEMORY_LIMIT, gpu.attrs, mem.total)
            mhz = self._call(gpu, "clock", nvml.nvmlDeviceGetClockInfo, gpu.handle, nvml.NVML_CLOCK_SM)
            if mhz is not None:
                store.add(n.GPU_CLOCK_SM, gpu.attrs, mhz * 1e6)
            milliwatts = self._call(gpu, "power", nvml.nvmlDeviceGetPowerUsage, gpu.handle)
            if milliwatts is not None:
                store.add(n.GPU_POWER_DRAW, gpu.attrs, milliwatts / 1000.0)
            celsius = self._call(
                gpu, "temperature", nvml.nvmlDeviceGetTemperature, gpu.handle, nvml.NVML_TEMPERATURE_GPU
            )
            if celsius is not None:
                store.add(n.GPU_TEMPERATURE, gpu.attrs, celsius)
            self._throttle(gpu)
            self._pcie(gpu)

    def _utilization(self, gpu: Gpu) -> None:
        nvml = self._nvml
        fallback = []
        for key, sampling, gauge in (
            ("utilization", nvml.NVML_GPU_UTILIZATION_SAMPLES, n.GPU_UTILIZATION),
            ("memory_controller", nvml.NVML_MEMORY_UTILIZATION_SAMPLES, n.GPU_MEMORY_CONTROLLER_UTILIZATION),
        ):
            if key in gpu.disabled:
                continue
            values = self._buffered(gpu, key, sampling) if gpu.buffered[key] else None
            if values is None or (not values and key not in gpu.has_value):
                # unsupported, or nothing buffered yet: an instant value rather than none
                fallback.append((key, gauge))
                continue
            for percent in values:
                self._store.add(gauge, gpu.attrs, percent / 100.0)
            gpu.has_value.add(key)
        if not fallback:
            return
        # No buffered samples on this model: one instant per tick instead.
        keys = [key for key, _ in fallback]
        rates = self._call(gpu, keys[0], nvml.nvmlDeviceGetUtilizationRates, gpu.handle, also=tuple(keys[1:]))
        if rates is None:
            return
        for key, gauge in fallback:
            percent = rates.gpu if key == "utilization" else rates.memory
            self._store.add(gauge, gpu.attrs, percent / 100.0)
            gpu.has_value.add(key)

    def _buffered(self, gpu: Gpu, key: str, sampling: int) -> list[float] | None:
        """New sample values (percent), [] when none arrived; None: not supported."""
        nvml = self._nvml
        first = key not in gpu.last_seen
        last = gpu.last_seen.get(key, 0)
        try:
            value_type, samples = nvml.nvmlDeviceGetSamples(gpu.handle, sampling, last)
        except nvml.NVMLError as exc:
            if isinstance(exc, getattr(nvml, "NVMLError_NotFound", ())):
                gpu.last_seen[key] = last
                return []  # no sample newer than `last`
            if permanent_error(nvml, exc):
                gpu.buffered[key] = False
                self._log_once(
                    f"buffered:{key}",
                    "GPU %d (%s): no buffered %s samples (%s); reading nvmlDeviceGetUtilizationRates once per tick",
                    gpu.index,
                    gpu.gpu[n.HW_MODEL],
                    key,
                    describe(exc),
                )
                return None
            self._log_once(
                f"error:{key}",
                "GPU %d: reading %s samples failed (%s)",
                gpu.index,
                key,
                describe(exc),
                level=logging.WARNING,
            )
            return []
        except Exception as exc:  # anything else: skip this tick
            self._log_once(
                f"error:{key}",
                "GPU %d: reading %s samples failed (%s)",
                gpu.index,
                key,
                describe(exc),
                level=logging.WARNING,
            )
            return []
        if not samples:
            gpu.last_seen[key] = last
            return []
        newest = max(s.timeStamp for s in samples)
        gpu.last_seen[key] = newest
        if first:
            # The first read returns the driver's whole buffer (seconds of history
            # before we started): keep only the newest sample.
            samples = [s for s in samples if s.timeStamp == newest][:1]
        return [sample_value(nvml, value_type, s.sampleValue) for s in samples]

    def _throttle(self, gpu: Gpu) -> None:
        nvml = self._nvml
        if "throttle" in gpu.disabled:
            return
        mask = None
        current = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if current is not None and not gpu.legacy_throttle:
            try:
                mask = current(gpu.handle)
            except Exception as exc:
                if isinstance(exc, getattr(nvml, "NVMLError_FunctionNotFound", ())):
                    gpu.legacy_throttle = True  # a driver older than the new name
                else:
                    self._handle_error(gpu, "throttle", exc)
                    return
        if mask is None:
            mask = self._call(gpu, "throttle", nvml.nvmlDeviceGetCurrentClocksThrottleReasons, gpu.handle)
            if mask is None:
                return
        for bit, reason in THROTTLE_REASONS:
            self._store.add(n.GPU_THROTTLE, gpu.with_attrs(**{n.THROTTLE_REASON: reason}), 1.0 if mask & bit else 0.0)

    def _pcie(self, gpu: Gpu) -> None:
        nvml = self._nvml
        # Each call counts bytes over a 20 ms window (blocking this thread, not the
        # training thread: ctypes releases the GIL).
        for counter, direction in (
            (nvml.NVML_PCIE_UTIL_TX_BYTES, "transmit"),
            (nvml.NVML_PCIE_UTIL_RX_BYTES, "receive"),
        ):
            kib_s = self._call(gpu, "pcie", nvml.nvmlDeviceGetPcieThroughput, gpu.handle, counter)
            if kib_s is None:
                return
            self._store.add(n.GPU_PCIE_THROUGHPUT, gpu.with_attrs(**{n.NETWORK_DIRECTION: direction}), kib_s * _KIB)

    # --- this process (every rank) ------------------------------------------------------
    def sample_process(self, now: float | None = None) -> None:
        nvml = self._nvml
        if nvml is None:
            return
        now = time.monotonic() if now is None else now
        for gpu in self.gpus:
            procs = self._call(gpu, "process_memory", nvml.nvmlDeviceGetComputeRunningProcesses, gpu.handle)
            if procs is not None:
                mine = [p.usedGpuMemory for p in procs if p.pid == self._pid]
                if mine:
                    gpu.process_seen = True
                    used = [m for m in mine if m is not None]  # None: not available (WDDM)
                    if used:
                        self._store.add(n.PROCESS_GPU_MEMORY_USAGE, gpu.proc_attrs, sum(used))
                elif gpu.process_seen:
                    # we used this GPU and released it: a real zero
                    self._store.add(n.PROCESS_GPU_MEMORY_USAGE, gpu.proc_attrs, 0)
            self._process_utilization(gpu, now)

    def _process_utilization(self, gpu: Gpu, now: float) -> None:
        nvml = self._nvml
        if "process_utilization" in gpu.disabled:
            return
        first = "process" not in gpu.last_seen
        last = gpu.last_seen.get("process", 0)
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(gpu.handle, last)
        except nvml.NVMLError as exc:
            # NotFound: no sample newer than `last`; pynvml raises NVMLError(0) when
            # the driver returned success with no sample at all
            if isinstance(exc, getattr(nvml, "NVMLError_NotFound", ())) or getattr(exc, "value", None) == 0:
                gpu.last_seen["process"] = last
            else:
                self._handle_error(gpu, "process_utilization", exc)
            samples = []
        except Exception as exc:
            self._handle_error(gpu, "process_utilization", exc)
            samples = []
        if samples:
            newest = max(s.timeStamp for s in samples)
            gpu.last_seen["process"] = newest
            mine = [s for s in samples if s.pid == self._pid]
            if first and mine:
                mine = [max(mine, key=lambda s: s.timeStamp)]  # skip buffered history
            for s in mine:
                self._store.add(n.PROCESS_GPU_UTILIZATION, gpu.proc_attrs, s.smUtil / 100.0)
            if mine:
                gpu.process_util_at = now
        if gpu.process_util_at is not None and now - gpu.process_util_at > PROCESS_UTILIZATION_STALE_S:
            gpu.process_util_at = None
            self._store.drop(n.PROCESS_GPU_UTILIZATION, gpu.proc_attrs)

    # --- errors --------------------------------------------------------------------------
    def _call(self, gpu: Gpu, key: str, fn, *args, also=()):
        """fn(*args), or None (after handling the error) when it fails."""
        if key in gpu.disabled:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            self._handle_error(gpu, key, exc, also=also)
            return None

    def _handle_error(self, gpu: Gpu, key: str, exc: BaseException, also=()) -> None:
        nvml = self._nvml
        if nvml is not None and permanent_error(nvml, exc):
            for k in (key,) + tuple(also):
                gpu.disabled.add(k)
                for gauge in _GAUGES[k]:
                    self._store.drop(gauge, gpu.attrs)
            gauges = ", ".join(g for k in (key,) + tuple(also) for g in _GAUGES[k])
            self._log_once(
                f"unsupported:{key}",
                "GPU %d (%s): %s not available (%s): %s absent",
                gpu.index,
                gpu.gpu[n.HW_MODEL],
                key,
                describe(exc),
                gauges,
            )
        else:
            self._log_once(
                f"error:{key}",
                "GPU %d: reading %s failed (%s); retrying each tick",
                gpu.index,
                key,
                describe(exc),
                level=logging.WARNING,
            )

    def _log_once(self, key: str, msg: str, *args, level: int = logging.INFO) -> None:
        if key in self._logged:
            return
        self._logged.add(key)
        _logger.log(level, msg, *args)
