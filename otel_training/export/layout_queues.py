"""Untraced steps' histogram values queued a layout run at a time (private to
``StepMetrics``).

Most steps of a loop share one layout (``aggregate/step_record.py``). For a run of
records of one layout, each phase's values form a column: it is converted and
queued for the histogram bank with C-level calls (``zip``, ``map``), rather than a
Python loop per phase per step, which was most of the pipeline's cost at short
steps. The bank bins queued values in bulk later. What comes out is exactly what
recording each step alone gives (tests/test_layouts.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby, repeat
from operator import sub, truediv
from typing import Protocol

from otel_training.aggregate.step_record import (
    BATCH_SIZE,
    BY_LAYOUT,
    MICROBATCHES,
    PHASE_NS,
    SKIPPED,
    UNTRACKED_KEY,
    UNTRACKED_NS,
    Layout,
    StepRecord,
    bounds,
)
from otel_training.export.histograms import HistogramBank, Series

_MAX_CACHED = 1024  # layouts whose series are looked up once
_NS = repeat(1e9)


class QueueOwner(Protocol):
    """What the queues use of the ``StepMetrics`` that owns them."""

    def phase_handle(self, mode: str, key: tuple[str, str]) -> Series: ...
    def step_series(self, mode: str, bank: HistogramBank) -> Series: ...
    def count(
        self, mode: str, steps: int, samples: int, queued: bool = True, microbatches: int = 0, skipped: int = 0
    ) -> None: ...


class LayoutQueues:
    """Queues untraced records' values into the bank's series, by layout run."""

    def __init__(self, metrics: QueueOwner, bank: HistogramBank) -> None:
        self._metrics = metrics  # the StepMetrics that owns this strategy
        self._bank = bank  # its bank
        self._series: dict[Layout, list[Series]] = {}

    def _series_of(self, layout: Layout) -> list[Series]:
        series = self._series.get(layout)
        if series is None:
            handle = self._metrics.phase_handle
            series = [handle(layout.mode, key) for key in layout.keys]
            if len(self._series) < _MAX_CACHED:
                self._series[layout] = series
        return series

    def add(self, records: Sequence[StepRecord]) -> None:
        metrics, bank = self._metrics, self._bank
        for layout, group in groupby(records, BY_LAYOUT):
            run = list(group)
            mode = layout.mode
            series = self._series_of(layout)
            untracked = [u for u in map(UNTRACKED_NS, run) if u > 0]
            untracked_series = metrics.phase_handle(mode, UNTRACKED_KEY) if untracked else None
            step_series = metrics.step_series(mode, bank)
            starts, ends = bounds(run)
            steps = map(sub, ends, starts)
            with bank.lock:  # the bank's series are read by the collecting thread
                if series:
                    for s, column in zip(series, zip(*map(PHASE_NS, run))):
                        s.pending.extend(map(truediv, column, _NS))
                if untracked_series is not None:
                    untracked_series.pending.extend(map(truediv, untracked, _NS))
                step_series.pending.extend(map(truediv, steps, _NS))
            metrics.count(
                mode,
                len(run),
                sum(filter(None, map(BATCH_SIZE, run))),
                microbatches=sum(map(MICROBATCHES, run)),
                skipped=sum(map(SKIPPED, run)),
            )
