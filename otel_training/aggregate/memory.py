"""Memory per step: the run's peaks and the memory-creep finding (pipeline thread).

A consumer of ``StepRecord`` batches: records that carry a ``MemoryReading``
(record/memory.py) are kept as (train step number, bytes at the step's end) points,
thinned to at most ``MAX_POINTS`` over the whole run. ``creep`` fits a line to
the points after warm-up: memory that grows steadily with the steps (a straight
line explains it, the last quarter never comes back down to the first quarter's
levels, and the growth is at least ``MIN_GROWTH``) is a leak -- typically tensors
kept across steps (``losses.append(loss)`` without ``.item()``).

``newest`` and ``window_peak`` hand the export gauges the newest reading and the
highest peaks since the previous collection. Every method takes ``_lock``: ``to_dict`` and ``window`` are
called from other threads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import compress
from operator import attrgetter
from typing import TYPE_CHECKING

from otel_training.aggregate.run_sections import Creep, Memory

MAX_POINTS = 4096  # beyond, every second point is dropped
MIN_POINTS = 12
MIN_SPAN_STEPS = 50
WARMUP_SHARE = 0.2  # the first fifth of the steps (at least WARMUP_STEPS) is warm-up
WARMUP_STEPS = 10
MIN_R2 = 0.8
MIN_GROWTH = 16 * 2**20  # bytes over the fitted steps
MB = 1e6
_MEMORY = attrgetter("memory")

if TYPE_CHECKING:
    from otel_training.aggregate.step_record import StepRecord
    from otel_training.record.memory import MemoryReading


def _number(record: StepRecord) -> int:
    """Where a reading lies, in train steps (an eval step: the train steps before it);
    before any train step (an eval-only run), the eval step's own number."""
    return record.train_before or record.number


class MemoryTrend:
    """Memory readings of a run: peaks, first and last, and the creep fit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: list[int] = []
        self._bytes: list[int] = []
        self._stride = 1  # keep every ``_stride``-th reading (doubles when full)
        self._seen = 0
        self.kind: str | None = None
        self.device: str | None = None
        self.first: int | None = None
        self.last: MemoryReading | None = None  # the newest reading
        self.peak_allocated = 0
        self.peak_reserved = 0
        self._window_allocated = 0
        self._window_reserved = 0
        self._last_allocated = 0
        self._last_reserved = 0

    def add(self, records: Sequence[StepRecord]) -> None:
        read = list(compress(records, map(_MEMORY, records)))  # (C-level: most steps have none)
        if not read:
            return
        with self._lock:
            for number, m in zip(map(_number, read), map(_MEMORY, read)):
                if self.kind != m.kind:  # CUDA initialized mid-run: the device's memory from now on
                    self._restart(m)
                self._seen += 1
                if self._seen % self._stride == 0:
                    self._steps.append(number)
                    self._bytes.append(m.current)
                    if len(self._steps) >= MAX_POINTS:
                        del self._steps[1::2], self._bytes[1::2]
                        self._stride *= 2
                if m.peak_allocated is not None:
                    self.peak_allocated = max(self.peak_allocated, m.peak_allocated)
                    self._window_allocated = max(self._window_allocated, m.peak_allocated)
                if m.peak_reserved is not None:
                    self.peak_reserved = max(self.peak_reserved, m.peak_reserved)
                    self._window_reserved = max(self._window_reserved, m.peak_reserved)
                self.last = m

    def _restart(self, m: MemoryReading) -> None:
        self.kind, self.device, self.first = m.kind, m.device, m.current
        self._steps, self._bytes, self._stride, self._seen = [], [], 1, 0
        self.peak_allocated = self.peak_reserved = 0

    def newest(self) -> MemoryReading | None:
        """The newest MemoryReading, or None."""
        return self.last

    def window_peak(self, reserved: bool = False) -> int:
        """The highest peak allocated (``reserved``: reserved) bytes since the previous
        call for it; the last such value when no CUDA reading came meanwhile (0 before
        the first)."""
        with self._lock:
            if reserved:
                out = self._window_reserved or self._last_reserved
                self._window_reserved, self._last_reserved = 0, out
            else:
                out = self._window_allocated or self._last_allocated
                self._window_allocated, self._last_allocated = 0, out
            return out

    def creep(self) -> dict | None:
        with self._lock:
            return creep(self._steps, self._bytes)

    def to_dict(self) -> dict | None:
        """The summary's ``memory`` section as the file's dict, or None without readings."""
        memory = self.section()
        return None if memory is None else memory.to_dict()

    def section(self) -> Memory | None:
        """The summary's ``memory`` section, or None without readings."""
        with self._lock:
            last = self.last
            if last is None:
                return None
            cuda = self.kind == "cuda"
            found = creep(self._steps, self._bytes)
            return Memory(
                kind=self.kind,
                device=self.device,
                first_bytes=self.first,
                last_bytes=last.current,
                peak_allocated_bytes=self.peak_allocated if cuda else None,
                peak_reserved_bytes=self.peak_reserved if cuda else None,
                alloc_retries=(last.alloc_retries or 0) if cuda else None,
                ooms=(last.ooms or 0) if cuda else None,
                creep=None if found is None else Creep(**found),
            )


def creep(steps: Sequence[int], values: Sequence[int]) -> dict | None:
    """The creep finding's facts, or None when memory does not grow steadily."""
    if len(steps) < MIN_POINTS or steps[-1] - steps[0] < MIN_SPAN_STEPS:
        return None
    cut = steps[0] + max(WARMUP_STEPS, WARMUP_SHARE * (steps[-1] - steps[0]))
    pts = [(s, v) for s, v in zip(steps, values) if s >= cut]
    n = len(pts)
    if n < MIN_POINTS:
        return None
    mx = sum(s for s, _ in pts) / n
    my = sum(v for _, v in pts) / n
    sxx = sum((s - mx) ** 2 for s, _ in pts)
    syy = sum((v - my) ** 2 for _, v in pts)
    sxy = sum((s - mx) * (v - my) for s, v in pts)
    if sxx <= 0 or syy <= 0 or sxy <= 0:
        return None
    slope = sxy / sxx  # bytes per step
    r2 = sxy * sxy / (sxx * syy)
    span = pts[-1][0] - pts[0][0]
    growth = slope * span
    quarter = max(1, n // 4)
    early, late = [v for _, v in pts[:quarter]], [v for _, v in pts[-quarter:]]
    if r2 < MIN_R2 or growth < MIN_GROWTH or min(late) <= max(early):
        return None
    return {
        "mb_per_100_steps": slope * 100 / MB,
        "growth_bytes": int(growth),
        "from_step": pts[0][0],
        "to_step": pts[-1][0],
        "r2": r2,
        "points": n,
    }
