"""Memory per step as observable instruments, read from ``aggregate.memory.MemoryTrend``.

At each collection: the newest step-end reading (``training.memory.allocated`` for a
CUDA device, ``training.memory.rss`` for a CPU run), the highest per-step peaks since
the previous collection (``training.memory.peak_allocated`` / ``peak_reserved``; the
last value again when no reading came meanwhile) and the allocator's cumulative retries and
out-of-memory errors as counters. CUDA points carry the GPU's ``hw.id``. The
instruments are made once per meter and read the ``MemoryMetrics`` made last
(``per_meter.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, Observation

from otel_training import semconv as sc
from otel_training.aggregate.memory import MemoryTrend
from otel_training.export.per_meter import Latest, latest

if TYPE_CHECKING:
    from otel_training.record.memory import MemoryReading


class MemoryMetrics:
    """The memory instruments of ``meter`` read ``trend`` from now on."""

    def __init__(self, meter: Any, common: dict, trend: MemoryTrend) -> None:
        self._trend = trend
        self._common = dict(common)
        self._attrs: dict[str | None, dict] = {}
        latest(meter, "memory", lambda slot: _create(meter, slot)).source = self

    def rebind(self, common: dict) -> None:
        """Report under ``common`` (the rank, once known) from now on."""
        self._common = dict(common)
        self._attrs = {}

    def _for(self, device: str | None) -> dict:
        attrs = self._attrs.get(device)
        if attrs is None:
            attrs = self._attrs[device] = (
                {**self._common, sc.ATTR_HW_ID: device} if device is not None else self._common
            )
        return attrs

    def _cuda(self) -> MemoryReading | None:
        m = self._trend.newest()
        return m if m is not None and m.kind == "cuda" else None

    def _allocated(self, options: CallbackOptions) -> Iterable[Observation]:
        m = self._cuda()
        return [Observation(m.current, self._for(m.device))] if m is not None else []

    def _peak(self, reserved: bool) -> list[Observation]:
        m = self._cuda()
        value = self._trend.window_peak(reserved)
        return [Observation(value, self._for(m.device))] if m is not None and value else []

    def _peak_allocated(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._peak(False)

    def _peak_reserved(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._peak(True)

    def _retries(self, options: CallbackOptions) -> Iterable[Observation]:
        m = self._cuda()
        return (
            [Observation(m.alloc_retries, self._for(m.device))] if m is not None and m.alloc_retries is not None else []
        )

    def _ooms(self, options: CallbackOptions) -> Iterable[Observation]:
        m = self._cuda()
        return [Observation(m.ooms, self._for(m.device))] if m is not None and m.ooms is not None else []

    def _rss(self, options: CallbackOptions) -> Iterable[Observation]:
        m = self._trend.newest()
        return [Observation(m.current, self._common)] if m is not None and m.kind == "cpu" else []


def _create(meter: Any, slot: Latest[MemoryMetrics]) -> None:
    gauge, counter = meter.create_observable_gauge, meter.create_observable_counter
    gauge(
        sc.METRIC_MEMORY_ALLOCATED,
        callbacks=[slot.reading(MemoryMetrics._allocated)],
        unit="By",
        description="Device memory allocated to tensors (PyTorch's caching allocator) at the end of a step",
    )
    gauge(
        sc.METRIC_MEMORY_PEAK_ALLOCATED,
        callbacks=[slot.reading(MemoryMetrics._peak_allocated)],
        unit="By",
        description="Highest device memory allocated to tensors during a step",
    )
    gauge(
        sc.METRIC_MEMORY_PEAK_RESERVED,
        callbacks=[slot.reading(MemoryMetrics._peak_reserved)],
        unit="By",
        description="Highest device memory reserved by PyTorch's caching allocator during a step",
    )
    counter(
        sc.METRIC_MEMORY_ALLOC_RETRIES,
        callbacks=[slot.reading(MemoryMetrics._retries)],
        unit="{retry}",
        description="Allocations the caching allocator retried after freeing its cache",
    )
    counter(
        sc.METRIC_MEMORY_OOMS,
        callbacks=[slot.reading(MemoryMetrics._ooms)],
        unit="{error}",
        description="CUDA out-of-memory errors raised by the caching allocator",
    )
    gauge(
        sc.METRIC_MEMORY_RSS,
        callbacks=[slot.reading(MemoryMetrics._rss)],
        unit="By",
        description="Resident set size of the process at the end of a step (runs without CUDA)",
    )
