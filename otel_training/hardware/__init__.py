"""Host and GPU hardware samples as OpenTelemetry observable gauges.

``start_hardware_metrics`` registers the gauges of docs/telemetry.md ("Hardware
gauges") on ``meter_provider.get_meter("otel_training.hardware")`` and starts the
background sampler. On a host running several ranks only one process (the holder of
a per-host file lock) samples the host and the GPUs; every process reports its own GPU
memory and utilization. See docs/hardware.md.
"""

from __future__ import annotations

import logging

from otel_training.hardware.agent_lock import HostLock
from otel_training.hardware.gauges import register_gauges
from otel_training.hardware.names import GPU_GAUGES, HOST_GAUGES
from otel_training.hardware.sampler import Sampler
from otel_training.hardware.stats import Store

__all__ = ["HardwareMetrics", "start_hardware_metrics", "METER_NAME"]

METER_NAME = "otel_training.hardware"

_logger = logging.getLogger("otel_training.hardware")


class HardwareMetrics:
    """Handle on a running sampler (or a no-op one when hardware metrics are off)."""

    def __init__(self, sampler: Sampler | None = None) -> None:
        self._sampler = sampler
        self._stopped = sampler is None

    def _attach(self, sampler: Sampler) -> None:
        self._sampler = sampler
        self._stopped = False

    @property
    def active(self) -> bool:
        return not self._stopped

    @property
    def is_host_sampler(self) -> bool:
        """Whether this process currently samples the host and GPUs for its host."""
        return self._sampler is not None and self._sampler.is_host_sampler

    def collect_once(self) -> None:
        """Take one sample now, on the calling thread (tests and benchmarks)."""
        if self._sampler is not None and not self._stopped:
            self._sampler.tick()

    def stop_sampling(self, timeout: float = 1.0) -> None:
        """Take a last sample and stop the thread (waits at most ``timeout`` s); the gauges
        still report, so that the next export carries the samples since the last one."""
        if self._stopped or self._sampler is None:
            return
        try:
            self._sampler.shutdown(timeout, final_tick=True)
        except Exception:
            _logger.warning("stopping the hardware sampler failed", exc_info=True)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Stop sampling (waits at most ``timeout`` s); the gauges then report nothing."""
        if self._stopped or self._sampler is None:
            return
        self._stopped = True
        try:
            self._sampler.shutdown(timeout)
        except Exception:
            _logger.warning("stopping the hardware sampler failed", exc_info=True)


def start_hardware_metrics(
    meter_provider, config, *, host_name: str, lock_path: str | None = None, start: bool = True, gpu: bool = True
) -> HardwareMetrics:
    """Register the hardware gauges and start sampling every ``config.hardware_interval`` s.

    Returns at once (NVML is initialised on the sampler thread) and never raises: a
    failure is logged and a no-op handle returned. ``lock_path`` overrides the per-host
    lock file; ``start=False`` registers the gauges without the thread (drive it with
    ``collect_once()``); ``gpu=False`` skips NVML.
    """
    try:
        if not getattr(config, "hardware", True):
            return HardwareMetrics(None)
        store = Store()
        meter = meter_provider.get_meter(METER_NAME)
        handle = HardwareMetrics(None)

        def active() -> bool:
            return handle.active

        def on_gpus() -> None:
            # GPU gauges exist only where NVML found GPUs (fewer callbacks per export)
            register_gauges(meter, store, active, GPU_GAUGES)

        sampler = Sampler(
            store, host_name, float(config.hardware_interval), lock=HostLock(lock_path), gpu=gpu, on_gpus=on_gpus
        )
        handle._attach(sampler)
        register_gauges(meter, store, active, HOST_GAUGES)
        if start:
            sampler.start()
        return handle
    except Exception:
        _logger.warning("hardware metrics disabled: setup failed", exc_info=True)
        return HardwareMetrics(None)
