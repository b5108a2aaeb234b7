"""NVML's side of GPU sampling: the state kept per GPU, which NVML errors are
permanent, and how samples and names decode. ``gpu.py`` reads through these into
the store."""

from __future__ import annotations

from otel_training.hardware import names as n
from otel_training.hardware.stats import attributes


class Gpu:
    """One GPU NVML found: its handle, its attributes, and what sampling it has learned."""

    def __init__(self, handle, index: int, uuid: str, model: str, host_name: str, pid: int) -> None:
        self.handle = handle
        self.index = index
        gpu = {n.HOST_NAME: host_name, n.HW_ID: uuid, n.HW_TYPE: "gpu", n.HW_MODEL: model, n.GPU_INDEX: index}
        self.gpu = gpu
        self.attrs = attributes(**gpu)
        self.proc_attrs = attributes(**gpu, **{n.PROCESS_PID: pid})
        self.disabled: set[str] = set()
        self.buffered = {"utilization": True, "memory_controller": True}
        # sampling key -> newest NVML timestamp seen (us); absent: never read, so the
        # next read returns the driver's whole buffer, history from before we started
        self.last_seen: dict[str, int] = {}
        self.has_value: set[str] = set()
        self.legacy_throttle = False
        self.process_seen = False
        self.process_util_at: float | None = None

    def with_attrs(self, **extra) -> tuple:
        return attributes(**self.gpu, **extra)


def permanent_error(nvml, exc: BaseException) -> bool:
    """Errors that will not go away on the next tick: the metric is dropped."""
    permanent = tuple(
        getattr(nvml, name)
        for name in ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_NoPermission")
        if hasattr(nvml, name)
    )
    return isinstance(exc, permanent) or isinstance(exc, (AttributeError, TypeError))


def sample_value(nvml, value_type: int, value) -> float:
    field = {
        nvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    }.get(value_type, "uiVal")  # utilization samples are unsigned int
    return float(getattr(value, field))


def as_text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
