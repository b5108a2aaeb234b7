"""The live run as a :class:`~otel_training.report.model.Report`: the run so far, or
its last windows, merged over ranks by the code ``otel-training report`` merges
summary files with (``report/sources.py``), and diagnosed by the same verdict
(``report/build.py``). What the screen shows besides: each mode's step-time
mean, the buckets its median and p90 lie in (the histogram's: no finer figure is
in the data) and its trend.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from otel_training.aggregate.run_model import Flops, Job, Memory, Series, Telemetry
from otel_training.diagnosis.evidence import RankSeries
from otel_training.report.build import diagnosed
from otel_training.report.model import Gpu, GpuUtilization, Ranked, RankRow, Report, TimeRange, Who
from otel_training.report.sources import ModeTotals

from .state import LiveRun, ModeLive, ProcessLive, Window

SOURCE_LIVE = "live"


@dataclass(frozen=True, slots=True)
class StepTimes:
    """A mode's step time, merged over ranks, seconds: the last windows' mean and the
    histogram buckets (low, high) their median and p90 lie in; the run's mean; the mean
    of each recent window (oldest first)."""

    last_mean_s: float | None
    p50_in: tuple[float, float] | None
    p90_in: tuple[float, float] | None
    mean_s: float | None
    trend_s: tuple[float, ...]


def bucket_of(q: float, bounds: tuple[float, ...], counts: list[float]) -> tuple[float, float] | None:
    """The bucket ``(low, high]`` the ``q`` quantile of the counts lies in."""
    total = sum(counts)
    if not total or len(counts) != len(bounds) + 1:
        return None
    edges = (0.0, *bounds, float("inf"))
    seen = 0.0
    for i, c in enumerate(counts):
        seen += c
        if seen >= q * total:
            return edges[i], edges[i + 1]
    return edges[-2], edges[-1]


def _add(totals: ModeTotals, proc: ProcessLive, m: ModeLive | None, windows: list[Window] | None) -> RankRow | None:
    """One process's numbers for a mode (``windows``: these alone; None: the run so far)."""
    if windows is None:
        if m is None or not m.steps:
            return None
        steps, step_s, samples = m.steps, m.step_s, m.samples
        phases = [(n, p, v[0], v[1]) for (n, p), v in m.phases.items()]
        tokens, flops = m.tokens, m.flops
    else:
        steps = sum(w.steps for w in windows)
        if not steps:
            return None
        step_s, samples = sum(w.step_s for w in windows), sum(w.samples for w in windows)
        merged: dict[tuple[str, str], list[float]] = {}
        for w in windows:
            for key, secs in w.phases.items():
                acc = merged.setdefault(key, [0.0, 0.0])
                acc[0] += secs
                acc[1] += w.counts.get(key, 0.0)
        phases = [(n, p, v[0], v[1]) for (n, p), v in merged.items()]
        tokens = flops = 0.0
    flop_count = None
    if flops and steps and step_s:
        flop_count = Flops(per_step=flops / steps, flop_s=flops / step_s, mfu=proc.mfu)
    return totals.add_rank(
        float(steps),
        float(samples),
        step_s,
        phases,
        {},
        None,
        tokens,
        flop_count,
        rank=proc.rank,
        host=proc.host,
        instance=proc.key,
    )


def live_report(run: LiveRun, last: int | None = None) -> Report:
    """The run so far (``last``: its last ``last`` windows of each process), diagnosed."""
    with run.lock:
        procs = run.ordered()
        modes: dict[str, ModeTotals] = {}
        ranks: dict[str, list[RankRow]] = {}
        for proc in procs:
            for name, m in proc.modes.items():
                windows = list(m.windows)[-last:] if last else None
                row = _add(modes.setdefault(name, ModeTotals()), proc, m, windows)
                if row is not None:
                    ranks.setdefault(name, []).append(row)
        gpus, memory, jobs, series = [], [], [], []
        for proc in procs:
            who = Who(proc.rank, proc.host, proc.key)
            for hw, g in proc.gpus.items():
                if "utilization" in g:
                    u = float(g["utilization"])
                    gpus.append(
                        Gpu(
                            host=proc.host,
                            gpu=hw,
                            index=str(g.get("index") or ""),
                            model=str(g.get("model") or ""),
                            mean=u,
                            min=u,
                        )
                    )
            rss = proc.gauges.get("training.memory.rss")
            alloc = proc.gauges.get("training.memory.allocated")
            if alloc is not None:
                peak = proc.gauges.get("training.memory.peak_allocated")
                memory.append(
                    Ranked(
                        who,
                        Memory(kind="cuda", last_bytes=int(alloc), peak_allocated_bytes=int(peak) if peak else None),
                    )
                )
            elif rss is not None:
                memory.append(Ranked(who, Memory(kind="cpu", last_bytes=int(rss))))
            wall = sum(proc.activities.values())
            if wall > 0:
                job = Job(
                    wall_s=wall, goodput=proc.activities.get("train", 0.0) / wall, activities=dict(proc.activities)
                )
                jobs.append(Ranked(who, job))
            series.append(
                RankSeries(
                    rank=proc.rank, host=proc.host, modes={k: _series(m) for k, m in proc.modes.items() if m.windows}
                )
            )
        utils = [g.mean for g in gpus]
        first = procs[0].resource if procs else {}
    report = Report(
        source=SOURCE_LIVE,
        service=str(first.get("service.name") or "") or None,
        run=str(first.get("training.run.id") or "") or None,
        range=TimeRange(),
        modes={name: totals.finish() for name, totals in modes.items()},
        ranks={name: tuple(rows) for name, rows in ranks.items()},
        gpus=tuple(gpus),
        gpu_utilization=GpuUtilization(mean=sum(utils) / len(utils), min=min(utils)) if utils else None,
        telemetry=Telemetry(),
        memory=tuple(memory),
        job=tuple(jobs),
        timeseries=tuple(series),
    )
    return diagnosed(report) if report.modes else report


def _series(m: ModeLive) -> Series:
    """A process's windows as the summary's time series (one window an export)."""
    ws = list(m.windows)
    names = sorted({n for w in ws for (n, p) in w.phases if p == "step"})
    return Series(
        width=1,
        t=tuple(w.at for w in ws),
        wall_s=tuple(0.0 for _ in ws),
        steps=tuple(w.steps for w in ws),
        step_s=tuple(w.step_s for w in ws),
        samples=tuple(int(round(w.samples)) for w in ws),
        phases={n: tuple(w.phases.get((n, "step"), 0.0) for w in ws) for n in names},
    )


def step_times(run: LiveRun, mode: str, last: int = 5, trend: int = 60) -> StepTimes:
    """``mode``'s step time over every process: the last ``last`` windows' mean and
    quantile buckets, the run's mean, the last ``trend`` windows' means."""
    with run.lock:
        ms = [p.modes[mode] for p in run.processes.values() if mode in p.modes]
        steps = sum(m.steps for m in ms)
        mean = sum(m.step_s for m in ms) / steps if steps else None
        counts: list[float] = []
        bounds: tuple[float, ...] = ()
        by_end: dict[int, list[float]] = {}
        recent = [0.0, 0.0]
        for m in ms:
            ws = list(m.windows)
            for w in ws[-last:]:
                recent[0] += w.step_s
                recent[1] += w.steps
                if w.bounds and (not bounds or w.bounds == bounds):
                    bounds = w.bounds
                    counts = [a + b for a, b in zip(counts or [0.0] * len(w.buckets), w.buckets)]
            for back, w in enumerate(reversed(ws[-trend:])):
                acc = by_end.setdefault(back, [0.0, 0.0])
                acc[0] += w.step_s
                acc[1] += w.steps
    means = [by_end[b][0] / by_end[b][1] for b in sorted(by_end, reverse=True) if by_end[b][1]]
    return StepTimes(
        last_mean_s=recent[0] / recent[1] if recent[1] else None,
        p50_in=bucket_of(0.5, bounds, counts),
        p90_in=bucket_of(0.9, bounds, counts),
        mean_s=mean,
        trend_s=tuple(means),
    )


def heat(run: LiveRun, mode: str, columns: int = 40) -> list[tuple[ProcessLive, list[float | None]]]:
    """Per process (by rank), the mean step time of each of its last ``columns`` windows."""
    with run.lock:
        out = []
        for proc in run.ordered():
            m = proc.modes.get(mode)
            if m is None or not m.windows:
                continue  # (a launcher, or a process of the other mode only)
            ws = list(m.windows)[-columns:]
            row: list[float | None] = [None] * (columns - len(ws))
            row.extend(w.step_s / w.steps if w.steps else None for w in ws)
            out.append((proc, row))
    return out


def median_interval(run: LiveRun) -> float | None:
    """The processes' export interval, as seen."""
    with run.lock:
        seen = [i for i in (p.interval_s() for p in run.processes.values()) if i is not None]
    return statistics.median(seen) if seen else None
