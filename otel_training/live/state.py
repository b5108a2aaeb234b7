"""The live run: OTLP metric requests, as the job exports them, folded into each
process's totals and a bounded window history (``otel-training top``).

One export is one window: the increase of every counter and histogram since the
process's previous export (cumulative points are differenced per series; delta points
taken as they are), the gauges' last values. Totals are the run so far, with the
summary's arithmetic: a phase's share is its seconds over the mode's step seconds,
samples per second the samples over the step seconds. Memory is bounded whatever the
run's length: ``WINDOWS`` windows a mode, ``MAX_PROCESSES`` processes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from otel_training import semconv as sc

WINDOWS = 600  # windows kept per process and mode (10 minutes at a 1 s export interval)
MAX_PROCESSES = 512  # beyond, the longest silent process is forgotten
_CUMULATIVE = 2  # AGGREGATION_TEMPORALITY_CUMULATIVE

_HOST_GAUGES = ("system.cpu.utilization", "system.linux.memory.available")
_GPU_GAUGES = {
    "hw.gpu.utilization": "utilization",
    "hw.gpu.memory.usage": "memory_used",
    "hw.gpu.memory.limit": "memory_limit",
    "hw.gpu.power.draw": "power",
}


@dataclass(slots=True)
class Window:
    """One export's increase for a mode."""

    at: float  # wall clock (s) the export reached the viewer
    steps: int = 0
    step_s: float = 0.0
    samples: float = 0.0
    phases: dict[tuple[str, str], float] = field(default_factory=dict)  # (phase, parent) -> seconds
    counts: dict[tuple[str, str], float] = field(default_factory=dict)  # (phase, parent) -> spans
    buckets: tuple[float, ...] = ()  # step-duration bucket counts (not cumulative)
    bounds: tuple[float, ...] = ()


class ModeLive:
    """A process's numbers for one mode: the run so far and its last windows."""

    __slots__ = ("steps", "step_s", "samples", "tokens", "flops", "phases", "idle_s", "buckets", "bounds", "windows")

    def __init__(self) -> None:
        self.steps = 0
        self.step_s = 0.0
        self.samples = 0.0
        self.tokens = 0.0
        self.flops = 0.0
        self.phases: dict[tuple[str, str], list[float]] = {}  # (name, parent) -> [seconds, count]
        self.idle_s = 0.0
        self.buckets: list[float] = []  # step-duration bucket counts over the run
        self.bounds: tuple[float, ...] = ()
        self.windows: deque[Window] = deque(maxlen=WINDOWS)

    def phase_shares(self) -> dict[tuple[str, str], float]:
        st = self.step_s
        return {k: (v[0] / st if st else 0.0) for k, v in self.phases.items()}


class ProcessLive:
    """One exporting process (one OTLP resource: ``service.instance.id``)."""

    def __init__(self, key: str, resource: dict[str, Any]) -> None:
        self.key = key
        self.resource = resource
        now = time.monotonic()
        self.first_seen = self.last_seen = now
        self.exports = 0
        self.gaps: deque[float] = deque(maxlen=8)  # seconds between its last exports
        self.modes: dict[str, ModeLive] = {}
        self.activities: dict[str, float] = {}  # training.job.time totals (s)
        self.gauges: dict[str, float] = {}  # the latest value of each scalar gauge
        self.mfu: float | None = None
        self.gpus: dict[str, dict[str, Any]] = {}  # hw.id -> latest GPU gauges
        self.exited: int | None = None  # the exit status, when the viewer launched it
        self.who: dict[str, Any] = {}  # training.rank, training.world_size, as its points carry them
        self._last: dict[tuple, tuple] = {}  # cumulative series -> (start, count, sum, buckets)

    # -- who -----------------------------------------------------------------------------------
    @property
    def rank(self) -> int | None:
        """The rank its points carry (known once its process group is)."""
        r = self.who.get(sc.ATTR_RANK, self.resource.get(sc.ATTR_RANK))
        return int(r) if isinstance(r, int) or (isinstance(r, str) and r.isdigit()) else None

    @property
    def host(self) -> str:
        return str(self.resource.get(sc.ATTR_HOST_NAME) or "")

    @property
    def ended(self) -> bool:
        """Its last export came from its shutdown (the job's ``shutdown`` time)."""
        return self.activities.get("shutdown", 0.0) > 0 or self.exited is not None

    def silent_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.last_seen

    def interval_s(self) -> float | None:
        """The process's export interval, as seen (the median gap)."""
        gaps = sorted(self.gaps)
        return gaps[len(gaps) // 2] if gaps else None

    def mode(self, name: str) -> ModeLive:
        m = self.modes.get(name)
        if m is None:
            m = self.modes[name] = ModeLive()
        return m

    # -- one export ------------------------------------------------------------------------------
    def take(self, metrics: Iterable[Any], at: float) -> None:
        now = time.monotonic()
        if self.exports:
            self.gaps.append(now - self.last_seen)
        self.last_seen = now
        self.exports += 1
        windows: dict[str, Window] = {}

        def window(mode: str) -> Window:
            w = windows.get(mode)
            if w is None:
                w = windows[mode] = Window(at)
            return w

        for metric in metrics:
            self._metric(metric, window)
        for mode, w in windows.items():
            if w.steps or w.step_s or w.phases:
                self.mode(mode).windows.append(w)

    def _delta(self, key: tuple, point: Any, temporality: int, hist: bool) -> tuple[float, float, list[float]]:
        """(count or value, sum, buckets) added since the last export of this series."""
        if hist:
            value, total, buckets = float(point.count), float(point.sum), [float(b) for b in point.bucket_counts]
        else:
            value = float(point.as_double if point.WhichOneof("value") == "as_double" else point.as_int)
            total, buckets = 0.0, []
        if temporality != _CUMULATIVE:
            return value, total, buckets
        start = point.start_time_unix_nano
        last = self._last.get(key)
        self._last[key] = (start, value, total, buckets)
        if last is None or last[0] != start or value < last[1]:  # new series, or restarted: from 0
            return value, total, buckets
        old = last[3]
        if len(old) == len(buckets):
            buckets = [b - o for b, o in zip(buckets, old)]
        return value - last[1], total - last[2], buckets

    def _metric(self, metric: Any, window: Any) -> None:
        name = metric.name
        kind = metric.WhichOneof("data")
        if kind == "histogram":
            if name not in (sc.METRIC_STEP_DURATION, sc.METRIC_PHASE_DURATION):
                return
            temporality = metric.histogram.aggregation_temporality
            for p in metric.histogram.data_points:
                attrs = _attributes(p.attributes)
                if sc.ATTR_RANK in attrs:
                    self.who[sc.ATTR_RANK] = attrs[sc.ATTR_RANK]
                    self.who[sc.ATTR_WORLD_SIZE] = attrs.get(sc.ATTR_WORLD_SIZE)
                mode = str(attrs.get(sc.ATTR_MODE) or "")
                if not mode or mode == sc.MODE_BETWEEN:
                    continue
                key = (name, tuple(sorted(attrs.items())))
                count, total, buckets = self._delta(key, p, temporality, True)
                m, w = self.mode(mode), window(mode)
                if name == sc.METRIC_STEP_DURATION:
                    m.steps += int(round(count))
                    m.step_s += total
                    w.steps += int(round(count))
                    w.step_s += total
                    bounds = tuple(p.explicit_bounds)
                    if len(buckets) == len(bounds) + 1:
                        if m.bounds != bounds:
                            m.bounds, m.buckets = bounds, [0.0] * len(buckets)
                        m.buckets = [a + b for a, b in zip(m.buckets, buckets)]
                        w.buckets, w.bounds = tuple(buckets), bounds
                else:
                    phase = str(attrs.get(sc.ATTR_PHASE) or "")
                    parent = str(attrs.get(sc.ATTR_PHASE_PARENT) or sc.SPAN_STEP)
                    acc = m.phases.setdefault((phase, parent), [0.0, 0.0])
                    acc[0] += total
                    acc[1] += count
                    w.phases[(phase, parent)] = w.phases.get((phase, parent), 0.0) + total
                    w.counts[(phase, parent)] = w.counts.get((phase, parent), 0.0) + count
        elif kind == "sum":
            temporality = metric.sum.aggregation_temporality
            for p in metric.sum.data_points:
                attrs = _attributes(p.attributes)
                key = (name, tuple(sorted(attrs.items())))
                value, _, _ = self._delta(key, p, temporality, False)
                mode = str(attrs.get(sc.ATTR_MODE) or "")
                if name == sc.METRIC_JOB_TIME:
                    activity = str(attrs.get(sc.ATTR_ACTIVITY) or "")
                    self.activities[activity] = self.activities.get(activity, 0.0) + value
                elif mode and mode != sc.MODE_BETWEEN:
                    if name == sc.METRIC_SAMPLES:
                        self.mode(mode).samples += value
                        window(mode).samples += value
                    elif name == sc.METRIC_TOKENS:
                        self.mode(mode).tokens += value
                    elif name == sc.METRIC_FLOPS:
                        self.mode(mode).flops += value
                    elif name == sc.METRIC_GPU_IDLE:
                        self.mode(mode).idle_s += value
        elif kind == "gauge":
            for p in metric.gauge.data_points:
                value = float(p.as_double if p.WhichOneof("value") == "as_double" else p.as_int)
                attrs = _attributes(p.attributes)
                gpu = _GPU_GAUGES.get(name)
                if gpu is not None:
                    hw = str(attrs.get(sc.ATTR_HW_ID) or attrs.get("gpu.index") or "")
                    entry = self.gpus.setdefault(hw, {"model": attrs.get("hw.model"), "index": attrs.get("gpu.index")})
                    entry[gpu] = value
                elif name == sc.METRIC_MFU:
                    self.mfu = value
                elif name in _HOST_GAUGES or name in (
                    sc.METRIC_GOODPUT,
                    sc.METRIC_MEMORY_RSS,
                    sc.METRIC_MEMORY_ALLOCATED,
                    sc.METRIC_MEMORY_PEAK_ALLOCATED,
                    sc.METRIC_PHASE_OPEN_DURATION,
                ):
                    self.gauges[name] = value


class LiveRun:
    """Every process that exported to the viewer (any thread adds; the screen reads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.processes: dict[str, ProcessLive] = {}
        self.started = time.monotonic()

    def add(self, request: Any) -> None:
        """An ``ExportMetricsServiceRequest``."""
        at = time.time()
        with self.lock:
            for rm in request.resource_metrics:
                resource = _attributes(rm.resource.attributes)
                key = str(
                    resource.get("service.instance.id")
                    or (resource.get(sc.ATTR_HOST_NAME), resource.get("process.pid"))
                )
                proc = self.processes.get(key)
                if proc is None:
                    if len(self.processes) >= MAX_PROCESSES:
                        oldest = min(self.processes.values(), key=lambda p: p.last_seen)
                        del self.processes[oldest.key]
                    proc = self.processes[key] = ProcessLive(key, resource)
                else:
                    proc.resource = resource  # (the rank is known once the process group is)
                proc.take((m for sm in rm.scope_metrics for m in sm.metrics), at)

    def job_ended(self, code: int) -> None:
        """The job the viewer launched exited with ``code``: every process of it ended."""
        with self.lock:
            for proc in self.processes.values():
                if proc.exited is None:
                    proc.exited = code

    def ordered(self) -> list[ProcessLive]:
        """The processes by rank (the unranked by when they were first seen)."""
        return sorted(self.processes.values(), key=lambda p: (p.rank is None, p.rank or 0, p.first_seen))


def _attributes(kvs: Iterable[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        v = kv.value
        which = v.WhichOneof("value")
        out[kv.key] = (
            getattr(v, which) if which in ("string_value", "int_value", "double_value", "bool_value") else None
        )
    return out
