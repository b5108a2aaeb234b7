"""A fake ``pynvml`` (nvidia-ml-py) for tests on machines without an NVIDIA GPU.

Installed at the import boundary: the ``fake_nvml`` fixture (``from tests.fake_pynvml import
fake_nvml`` in a test module; tests/test_hardware_gpu.py
and friends) puts this module in ``sys.modules["pynvml"]``, so ``import pynvml`` in
otel_training gets it. It mimics the real library where our code can tell:

* the same function names and signatures, raising ``NVMLError_Uninitialized`` before
  ``nvmlInit()``;
* the same return types: ctypes structures with the real field names
  (``c_nvmlMemory_t`` .total/.free/.used, ``c_nvmlUtilization_t`` .gpu/.memory,
  ``c_nvmlSample_t`` .timeStamp/.sampleValue (a ``c_nvmlValue_t`` union),
  ``c_nvmlProcessUtilizationSample_t``), process lists of ``nvmlFriendlyObject``,
  strings for UUIDs and names, milliwatts, MHz, KB/s;
* the same errors: ``NVMLError(code)`` builds the subclass for the code
  (``NVMLError_NotSupported``, ``NVMLError_LibraryNotFound``, ...), generated from the
  ``NVML_ERROR_*`` constants exactly as pynvml does; ``NVMLError_NotFound`` when no
  buffered sample is newer than the last-seen timestamp;
* constants with the real names and values (tests/test_hardware_fake_nvml.py checks
  them against the installed pynvml).

Drive it with :func:`configure` (the GPUs, or an ``nvmlInit`` error) and the
:class:`FakeGpu` fields and ``push_*`` methods. ``unsupported`` names the functions
that raise ``NVMLError_NotSupported`` on that GPU.
"""

from __future__ import annotations

import string
import sys
from ctypes import (Structure, Union, c_double, c_int, c_longlong, c_uint, c_ulong,
                    c_ulonglong, c_ushort)
from typing import List, Optional, Set, Tuple

# --- constants (values as in pynvml / nvml.h) --------------------------------------
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_CLOCK_VIDEO = 3

NVML_TOTAL_POWER_SAMPLES = 0
NVML_GPU_UTILIZATION_SAMPLES = 1
NVML_MEMORY_UTILIZATION_SAMPLES = 2

NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4

NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1

nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonApplicationsClocksSetting = 0x2
nvmlClocksEventReasonSwPowerCap = 0x4
nvmlClocksEventReasonHwSlowdown = 0x8
nvmlClocksEventReasonSyncBoost = 0x10
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
nvmlClocksEventReasonDisplayClockSetting = 0x100
nvmlClocksEventReasonNone = 0x0
nvmlClocksThrottleReasonGpuIdle = 0x1
nvmlClocksThrottleReasonApplicationsClocksSetting = 0x2
nvmlClocksThrottleReasonSwPowerCap = 0x4
nvmlClocksThrottleReasonHwSlowdown = 0x8
nvmlClocksThrottleReasonSyncBoost = 0x10
nvmlClocksThrottleReasonSwThermalSlowdown = 0x20
nvmlClocksThrottleReasonHwThermalSlowdown = 0x40
nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x80
nvmlClocksThrottleReasonDisplayClockSetting = 0x100
nvmlClocksThrottleReasonNone = 0x0


# --- errors: the same class hierarchy and construction as pynvml ------------------------
class NVMLError(Exception):
    _valClassMapping: dict = {}

    def __new__(typ, value):
        if typ == NVMLError:
            typ = NVMLError._valClassMapping.get(value, typ)
        obj = Exception.__new__(typ)
        obj.value = value
        return obj

    def __str__(self):
        return _ERROR_STRINGS.get(self.value, "NVML Error with code %d" % self.value)

    def __eq__(self, other):
        return self.value == other.value

    __hash__ = Exception.__hash__


_ERROR_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


def _extract_errors_as_classes() -> None:
    # NVML_ERROR_NOT_SUPPORTED -> NVMLError_NotSupported, as pynvml does
    module = sys.modules[__name__]
    for err_name in [x for x in dir(module) if x.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(
            err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        err_val = getattr(module, err_name)

        def gen_new(val):
            def new(typ, *args):
                return NVMLError.__new__(typ, val)
            return new

        cls = type(class_name, (NVMLError,), {"__new__": gen_new(err_val)})
        cls.__module__ = __name__
        setattr(module, class_name, cls)
        NVMLError._valClassMapping[err_val] = cls


_extract_errors_as_classes()


# --- return types (same fields as pynvml's) ----------------------------------------
class c_nvmlMemory_t(Structure):
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]


class c_nvmlUtilization_t(Structure):
    _fields_ = [("gpu", c_uint), ("memory", c_uint)]


class c_nvmlValue_t(Union):
    _fields_ = [("dVal", c_double), ("uiVal", c_uint), ("ulVal", c_ulong),
                ("ullVal", c_ulonglong), ("sllVal", c_longlong), ("siVal", c_int),
                ("usVal", c_ushort)]


class c_nvmlSample_t(Structure):
    _fields_ = [("timeStamp", c_ulonglong), ("sampleValue", c_nvmlValue_t)]


class c_nvmlProcessUtilizationSample_t(Structure):
    _fields_ = [("pid", c_uint), ("timeStamp", c_ulonglong), ("smUtil", c_uint),
                ("memUtil", c_uint), ("encUtil", c_uint), ("decUtil", c_uint)]


class nvmlFriendlyObject:
    def __init__(self, dictionary):
        for key, value in dictionary.items():
            setattr(self, key, value)


class c_nvmlDevice_t:
    """Opaque handle (a ctypes pointer in pynvml)."""

    def __init__(self, index: int) -> None:
        self.index = index


# --- the fake machine ------------------------------------------------------------------
class FakeGpu:
    def __init__(self, index: int = 0, uuid: Optional[str] = None,
                 name: str = "NVIDIA H100 80GB HBM3", total: int = 80 * 2**30) -> None:
        self.index = index
        self.uuid = uuid or f"GPU-00000000-0000-0000-0000-00000000000{index}"
        self.name = name
        self.memory = (total, total - 2**30, 2**30)  # total, free, used
        self.utilization = (0, 0)  # nvmlDeviceGetUtilizationRates: gpu %, memory %
        self.sm_clock_mhz = 1980
        self.power_mw = 350_000
        self.temperature_c = 45
        self.throttle_mask = 0
        self.pcie_kb_s = (1000, 2000)  # tx, rx
        self.processes: List[Tuple[int, Optional[int]]] = []  # (pid, usedGpuMemory)
        self.unsupported: Set[str] = set()  # function names raising NotSupported
        self.errors: dict = {}  # function name -> NVML error code raised once per call
        self.samples = {NVML_GPU_UTILIZATION_SAMPLES: [], NVML_MEMORY_UTILIZATION_SAMPLES: []}
        self.process_samples: List[Tuple[int, int, int]] = []  # (pid, timeStamp, smUtil)
        self._clock_us = 1_700_000_000_000_000

    def _next_ts(self) -> int:
        self._clock_us += 166_667  # NVML buffers a sample every 1/6 s on big GPUs
        return self._clock_us

    def push_utilization(self, *percents: int, memory: bool = False) -> None:
        """Append buffered samples (NVML_GPU_ or NVML_MEMORY_UTILIZATION_SAMPLES)."""
        kind = NVML_MEMORY_UTILIZATION_SAMPLES if memory else NVML_GPU_UTILIZATION_SAMPLES
        for p in percents:
            self.samples[kind].append((self._next_ts(), p))

    def push_process_utilization(self, pid: int, *percents: int) -> None:
        for p in percents:
            self.process_samples.append((pid, self._next_ts(), p))


_state = {"init_error": None, "initialized": 0, "gpus": [], "calls": {}}


def configure(gpus: Optional[List[FakeGpu]] = None, init_error: Optional[int] = None) -> None:
    """Reset the fake: these GPUs, or ``nvmlInit`` raising ``NVMLError(init_error)``."""
    _state.update(init_error=init_error, initialized=0, gpus=list(gpus or []), calls={})


def calls(name: str) -> int:
    return _state["calls"].get(name, 0)


def _enter(name: str, handle: Optional[c_nvmlDevice_t] = None) -> Optional[FakeGpu]:
    _state["calls"][name] = _state["calls"].get(name, 0) + 1
    if not _state["initialized"]:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if handle is None:
        return None
    gpu = _state["gpus"][handle.index]
    if name in gpu.unsupported:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if name in gpu.errors:
        raise NVMLError(gpu.errors[name])
    return gpu


def nvmlInit():
    _state["calls"]["nvmlInit"] = _state["calls"].get("nvmlInit", 0) + 1
    if _state["init_error"] is not None:
        raise NVMLError(_state["init_error"])
    _state["initialized"] += 1


def nvmlShutdown():
    _enter("nvmlShutdown")
    _state["initialized"] -= 1


def nvmlDeviceGetCount():
    _enter("nvmlDeviceGetCount")
    return len(_state["gpus"])


def nvmlDeviceGetHandleByIndex(index):
    _enter("nvmlDeviceGetHandleByIndex")
    if not 0 <= index < len(_state["gpus"]):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return c_nvmlDevice_t(index)


def nvmlDeviceGetUUID(handle):
    return _enter("nvmlDeviceGetUUID", handle).uuid


def nvmlDeviceGetName(handle):
    return _enter("nvmlDeviceGetName", handle).name


def nvmlDeviceGetIndex(handle):
    return _enter("nvmlDeviceGetIndex", handle).index


def nvmlDeviceGetMemoryInfo(handle, version=None):
    total, free, used = _enter("nvmlDeviceGetMemoryInfo", handle).memory
    return c_nvmlMemory_t(total=total, free=free, used=used)


def nvmlDeviceGetUtilizationRates(handle):
    gpu, memory = _enter("nvmlDeviceGetUtilizationRates", handle).utilization
    return c_nvmlUtilization_t(gpu=gpu, memory=memory)


def nvmlDeviceGetSamples(device, sampling_type, timeStamp):
    gpu = _enter("nvmlDeviceGetSamples", device)
    if sampling_type not in gpu.samples:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    newer = [(ts, v) for ts, v in gpu.samples[sampling_type] if ts > timeStamp]
    if not newer:
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    out = []
    for ts, value in newer:
        sample = c_nvmlSample_t(timeStamp=ts)
        sample.sampleValue.uiVal = value
        out.append(sample)
    return (NVML_VALUE_TYPE_UNSIGNED_INT, out)


def nvmlDeviceGetClockInfo(handle, type):
    gpu = _enter("nvmlDeviceGetClockInfo", handle)
    if type != NVML_CLOCK_SM:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return gpu.sm_clock_mhz


def nvmlDeviceGetPowerUsage(handle):
    return _enter("nvmlDeviceGetPowerUsage", handle).power_mw


def nvmlDeviceGetTemperature(handle, sensor):
    return _enter("nvmlDeviceGetTemperature", handle).temperature_c


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    return _enter("nvmlDeviceGetCurrentClocksEventReasons", handle).throttle_mask


def nvmlDeviceGetCurrentClocksThrottleReasons(handle):
    return _enter("nvmlDeviceGetCurrentClocksThrottleReasons", handle).throttle_mask


def nvmlDeviceGetPcieThroughput(device, counter):
    tx, rx = _enter("nvmlDeviceGetPcieThroughput", device).pcie_kb_s
    return tx if counter == NVML_PCIE_UTIL_TX_BYTES else rx


def nvmlDeviceGetComputeRunningProcesses(handle):
    gpu = _enter("nvmlDeviceGetComputeRunningProcesses", handle)
    return [nvmlFriendlyObject({"pid": pid, "usedGpuMemory": used, "gpuInstanceId": 0xFFFFFFFF,
                                "computeInstanceId": 0xFFFFFFFF})
            for pid, used in gpu.processes]


def nvmlDeviceGetProcessUtilization(handle, timeStamp):
    gpu = _enter("nvmlDeviceGetProcessUtilization", handle)
    newer = [s for s in gpu.process_samples if s[1] > timeStamp]
    if not newer:
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    return [c_nvmlProcessUtilizationSample_t(pid=pid, timeStamp=ts, smUtil=sm)
            for pid, ts, sm in newer]


# --- the pytest fixture ---------------------------------------------------------------
try:
    import pytest
except ImportError:  # used outside pytest (a subprocess of a test)
    pytest = None


def install() -> "object":
    """Put this module in ``sys.modules["pynvml"]`` (for subprocesses; tests use the fixture)."""
    module = sys.modules[__name__]
    sys.modules["pynvml"] = module
    return module


if pytest is not None:
    @pytest.fixture
    def fake_nvml(monkeypatch):
        """This module as ``pynvml``, with one idle H100; reconfigure with ``configure()``."""
        module = sys.modules[__name__]
        configure([FakeGpu(0)])
        monkeypatch.setitem(sys.modules, "pynvml", module)
        yield module
        configure()
