"""The run over time, compact and bounded: what the HTML report charts.

A consumer of ``StepRecord`` batches (pipeline thread), like the run summary. Per
mode, the run is cut into *windows* of consecutive steps; each window keeps its
step count, step time, samples, wall time, the time per top-level phase, GPU idle
time and a few quantile points of its step durations (for p50/p90).

Bounded: at most ``MAX_WINDOWS`` windows per mode. Windows start one step wide;
when ``MAX_WINDOWS`` are full, neighbours merge pairwise and the width doubles, so
a run of any length keeps between ``MAX_WINDOWS / 2`` and ``MAX_WINDOWS`` of them,
and at most ``MAX_PHASES`` phase columns (the rest are summed as ``other``). The
JSON of one mode is at most about 60 kB, whatever the run's length.

Quantiles are exact while a window holds at most ``POINTS`` steps; beyond, a
window keeps ``POINTS`` evenly spaced quantile points and merging two windows
resamples their union, a small sketch whose p50/p90 stay within a few percent.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import groupby
from operator import attrgetter, sub

from otel_training import semconv as sc
from otel_training.aggregate.run_sections import Series
from otel_training.aggregate.step_record import (
    BATCH_SIZE,
    BY_LAYOUT,
    IDLE_NS,
    PHASE_NS,
    UNTRACKED_NS,
    Layout,
    StepRecord,
    bounds,
)
from otel_training.record.flops import SOURCE_MEASURED

_WAITS = frozenset((sc.PHASE_COMMUNICATION, sc.PHASE_REDUCE_METRICS))

MAX_WINDOWS = 128
POINTS = 16  # quantile points kept per window
MAX_PHASES = 12  # phase columns written per mode (the largest); the rest become "other"
_MAX_NAMES = 64  # distinct phase names tracked per mode; later ones are counted as "other"
OTHER = "other"
_MODE = attrgetter("mode")
_POSITIVE = (0).__lt__


def _resample(ordered: list, n: int) -> list:
    """``n`` evenly spaced quantile points of a sorted list (each stands for the
    same share of the steps)."""
    size = len(ordered)
    if size <= n:
        return ordered
    return [ordered[int((i + 0.5) * size / n)] for i in range(n)]


class _Window:
    __slots__ = (
        "first",
        "steps",
        "start",
        "end",
        "step_ns",
        "max_ns",
        "samples",
        "points",
        "phases",
        "idle_ns",
        "wait_ns",
        "seg_first",
        "seg_last",
    )

    def __init__(self) -> None:
        self.first = -1  # the first step number
        self.seg_first = self.seg_last = 0  # the mode's uninterrupted runs it holds
        self.steps = 0
        self.start = 0  # perf_counter ns
        self.end = 0
        self.step_ns = 0
        self.max_ns = 0
        self.samples = 0
        self.points: list[int] = []  # step durations (raw while open, then quantile points)
        self.phases: dict[str, int] = {}
        self.idle_ns = 0
        self.wait_ns = 0  # waits for other ranks: communication, reduce_metrics (any parent)

    def merge(self, other: _Window) -> None:
        self.first = min(self.first, other.first)
        self.seg_first = min(self.seg_first, other.seg_first) if self.steps else other.seg_first
        self.seg_last = max(self.seg_last, other.seg_last)
        self.steps += other.steps
        self.start = min(self.start, other.start)
        self.end = max(self.end, other.end)
        self.step_ns += other.step_ns
        self.max_ns = max(self.max_ns, other.max_ns)
        self.samples += other.samples
        self.points = _resample(sorted(self.points + other.points), POINTS)
        for name, ns in other.phases.items():
            self.phases[name] = self.phases.get(name, 0) + ns
        self.idle_ns += other.idle_ns
        self.wait_ns += other.wait_ns


class _Series:
    """The windows of one mode."""

    __slots__ = ("width", "windows", "open", "columns", "names", "seg", "waits")

    def __init__(self) -> None:
        self.seg = 0  # uninterrupted runs of the mode so far (another mode ran between them)
        self.width = 1  # steps per window
        self.windows: list[_Window] = []
        self.open = _Window()
        self.columns: dict[Layout, list[tuple[int, str]]] = {}  # a layout's top-level phases
        self.names: set[str] = set()
        self.waits: dict[Layout, list[int]] = {}  # a layout's indices of its waits

    def _columns(self, layout: Layout) -> list[tuple[int, str]]:
        cols = self.columns.get(layout)
        if cols is None:
            waits = [i for i, (name, _parent) in enumerate(layout.keys) if name in _WAITS]
            if len(self.waits) < 1024:
                self.waits[layout] = waits
            cols = []
            for i, (name, parent) in enumerate(layout.keys):
                if parent != sc.SPAN_STEP:
                    continue
                if name not in self.names and len(self.names) >= _MAX_NAMES:
                    name = OTHER
                self.names.add(name)
                cols.append((i, name))
            if len(self.columns) < 1024:
                self.columns[layout] = cols
        return cols

    def interrupt(self) -> None:
        """Another mode ran since this mode's last step: the open window ends here, so
        that no window spans time in which this mode did not run."""
        if self.open.steps:
            self._close()
        self.seg += 1

    def add(self, run: list[StepRecord]) -> None:
        i, n = 0, len(run)
        while i < n:
            take = min(self.width - self.open.steps, n - i)
            self._fill(run[i : i + take] if take < n else run)
            i += take
            if self.open.steps >= self.width:
                self._close()

    def _fill(self, chunk: Sequence[StepRecord]) -> None:
        w = self.open
        starts, ends = bounds(chunk)
        durations = list(map(sub, ends, starts))
        first, start, end = chunk[0].number, min(starts), max(ends)
        if w.steps == 0:
            w.first, w.start, w.end = first, start, end
            w.seg_first = w.seg_last = self.seg
        else:
            w.first, w.start, w.end = min(w.first, first), min(w.start, start), max(w.end, end)
        w.steps += len(chunk)
        w.step_ns += sum(durations)
        w.max_ns = max(w.max_ns, max(durations))
        w.points.extend(durations)
        w.samples += sum(filter(None, map(BATCH_SIZE, chunk)))
        phases = w.phases
        for layout, group in groupby(chunk, BY_LAYOUT):
            cols = self._columns(layout)
            if not cols:
                continue
            sums = list(map(sum, zip(*map(PHASE_NS, group))))
            for j, name in cols:
                phases[name] = phases.get(name, 0) + sums[j]
            for j in self.waits.get(layout, ()):
                w.wait_ns += sums[j]
        untracked = sum(filter(_POSITIVE, map(UNTRACKED_NS, chunk)))  # (C-level: no Python per step)
        if untracked:
            phases[sc.PHASE_UNTRACKED] = phases.get(sc.PHASE_UNTRACKED, 0) + untracked
        for idle in filter(None, map(IDLE_NS, chunk)):
            w.idle_ns += sum(idle.values())

    def _close(self) -> None:
        w = self.open
        w.points = _resample(sorted(w.points), POINTS)
        self.windows.append(w)
        self.open = _Window()
        if len(self.windows) >= MAX_WINDOWS:
            # Neighbours merge pairwise, those of one uninterrupted run first; where
            # the runs are too short for that (the modes alternate every few steps),
            # across runs.
            merged = _pairs(self.windows, True)
            if len(merged) > MAX_WINDOWS * 3 // 4:
                merged = _pairs(merged, False)
            self.windows = merged
            self.width *= 2

    def section(self, offset: int) -> Series:
        windows = list(self.windows)
        if self.open.steps:
            last = _Window()
            last.merge(self.open)  # a copy, its points sorted and resampled
            last.first, last.start, last.end = self.open.first, self.open.start, self.open.end
            windows.append(last)
        totals: dict[str, int] = {}
        for w in windows:
            for name, ns in w.phases.items():
                totals[name] = totals.get(name, 0) + ns
        keep = sorted(totals, key=lambda name: -totals[name])
        if len(keep) > MAX_PHASES:
            keep = keep[: MAX_PHASES - 1]
        kept = set(keep)
        phases: dict[str, list] = {name: [] for name in keep}
        other: list = []
        names = ("t", "wall_s", "first_step", "steps", "step_s", "p50_s", "p90_s", "max_s", "samples")
        col: dict[str, list] = {k: [] for k in names}
        idle: list = []
        wait: list = []
        for w in windows:
            pts = w.points
            col["t"].append(round((w.start + offset) / 1e9, 3))
            col["wall_s"].append(_s(w.end - w.start))
            col["first_step"].append(w.first)
            col["steps"].append(w.steps)
            col["step_s"].append(_s(w.step_ns))
            col["p50_s"].append(_s(pts[min(len(pts) - 1, len(pts) // 2)]) if pts else 0.0)
            col["p90_s"].append(_s(pts[min(len(pts) - 1, int(0.9 * len(pts)))]) if pts else 0.0)
            col["max_s"].append(_s(w.max_ns))
            col["samples"].append(w.samples)
            idle.append(_s(w.idle_ns))
            wait.append(_s(w.wait_ns))
            for name in keep:
                phases[name].append(_s(w.phases.get(name, 0)))
            rest = sum(ns for name, ns in w.phases.items() if name not in kept)
            other.append(_s(rest))
        if any(other):
            phases[OTHER] = other
        return Series(
            width=self.width,
            **{k: tuple(v) for k, v in col.items()},
            phases={name: tuple(v) for name, v in phases.items()},
            gpu_idle_s=tuple(idle) if any(idle) else None,
            wait_s=tuple(wait) if any(wait) else None,  # a rank's own work per window: step_s minus wait_s
        )


def _pairs(windows: list[_Window], same_run: bool) -> list[_Window]:
    """Each window merged with the next (``same_run``: only when both hold the same
    uninterrupted run of the mode)."""
    out: list[_Window] = []
    k, n = 0, len(windows)
    while k < n:
        a = windows[k]
        if k + 1 < n and (not same_run or windows[k + 1].seg_first == a.seg_last):
            a.merge(windows[k + 1])
            k += 2
        else:
            k += 1
        out.append(a)
    return out


def _s(ns: int) -> float:
    return float(f"{ns / 1e9:.6g}")


class TimeSeries:
    """Windows of steps per mode. ``add`` runs on the pipeline thread; ``to_dict``
    may run on any (both under ``_lock``). ``offset`` maps perf_counter ns to epoch
    ns (the spans' base)."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self._modes: dict[str, _Series] = {}
        self._last: str | None = None  # the mode of the last step added
        self._counted = False  # the FLOP-count step was seen (and left out)
        self._lock = threading.Lock()

    def add(self, records: Sequence[StepRecord]) -> None:
        """Count a batch of finished steps: work per run of one mode, not per step."""
        with self._lock:
            for mode, steps in groupby(records, _MODE):
                run = list(steps)
                # The count is on every training step from the counted one on, never on
                # an eval step: a run's last step tells (the batch's may be an eval step).
                if not self._counted and run[-1].flops is not None:
                    run = self._without_counted(run)
                series = self._modes.get(mode)
                if series is None:
                    series = self._modes[mode] = _Series()
                elif self._last != mode:
                    series.interrupt()
                series.add(run)
                self._last = mode

    def _without_counted(self, run: list[StepRecord]) -> list[StepRecord]:
        """The run without the step FLOPs were counted on (it ran slower: the summary
        leaves it out of the step times and throughput too)."""
        self._counted = True
        i, flops = next((i, r.flops) for i, r in enumerate(run) if r.flops is not None)
        if flops.source != SOURCE_MEASURED:
            return run
        return run[:i] + run[i + 1 :]

    def to_dict(self) -> dict:
        """``{mode: {"width", "t", "wall_s", ..., "phases": {name: [s]}}}``: columns,
        one value per window (see docs/summary-file.md)."""
        return {mode: series.to_dict() for mode, series in self.section().items()}

    def section(self) -> dict[str, Series]:
        """The summary's ``timeseries`` section, mode by mode."""
        with self._lock:
            return {mode: s.section(self.offset) for mode, s in self._modes.items() if s.windows or s.open.steps}
