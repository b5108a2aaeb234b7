"""A run over time, for the HTML report and ``compare``: per-rank windows of steps.

Both sources give, per rank, the summary file's ``timeseries`` columns
(``aggregate/timeseries.py``): per mode ``t`` (window start, epoch s), ``wall_s``,
``steps``, ``step_s``, ``p50_s``, ``p90_s``, ``samples``, ``phases`` (seconds per
top-level phase) and ``gpu_idle_s``. Summary files carry them; from Prometheus they
are counter increases over a grid of at most ``MAX_POINTS`` windows, with p50/p90
from the step-duration histogram's buckets, plus GPU utilization and memory.
"""

from __future__ import annotations

import math

from otel_training.aggregate.run_model import Series
from otel_training.diagnosis.evidence import RankSeries
from otel_training.report.model import SOURCE_SUMMARY, GpuLine, Report
from otel_training.report.prometheus import RANK_LABELS, Prometheus
from otel_training.report.sources import ReportError

MAX_POINTS = 120  # windows per chart line


def _rank_int(label: str | None) -> int | None:
    return int(label) if label and label.isdigit() else None


class PrometheusSeries:
    """Per-rank windows over ``[start, end]`` from range queries (``/api/v1/query_range``)."""

    def __init__(self, prom: Prometheus, start: float, end: float) -> None:
        self.prom, self.start, self.end = prom, start, end
        self.step = max(15, int(math.ceil((end - start) / MAX_POINTS)))

    def _range(self, promql: str) -> list[dict]:
        return self.prom.query_range(promql, self.start, self.end, self.step)

    def _increases(self, metric: str, sel: str, by: tuple[str, ...]) -> dict[tuple, dict[float, float]]:
        """Per ``by`` key, per window end time: the counter's increase over the window
        (a series born inside the range counts from 0; a reset restarts from 0)."""
        out: dict[tuple, dict[float, float]] = {}
        q = f"last_over_time({metric}{{{sel}}}[{self.step}s])"
        for r in self._range(q):
            key = tuple(r["metric"].get(n, "") for n in by)
            slot = out.setdefault(key, {})
            prev = None
            for t, v in r["values"]:
                if prev is None:
                    prev = v
                    if t <= self.start + self.step / 2:
                        continue  # the value before the range: a baseline
                    delta = v
                else:
                    delta = v - prev if v >= prev else v
                    prev = v
                slot[t] = slot.get(t, 0.0) + delta
        return out

    def collect(self, sel: str, hosts: list[str]) -> tuple[tuple[RankSeries, ...], dict[str, tuple[GpuLine, ...]]]:
        """Per rank, its windows by mode; per gauge (``utilization``, ``memory``), each GPU's line."""
        by = RANK_LABELS + ("training_mode",)
        counts = self._increases("training_step_duration_seconds_count", sel, by)
        sums = self._increases("training_step_duration_seconds_sum", sel, by)
        samples = self._increases("training_samples_total", sel, by)
        phases = self._increases(
            "training_phase_duration_seconds_sum", f'{sel},training_phase_parent="step"', by + ("training_phase",)
        )
        idle = self._increases("training_gpu_idle_seconds_total", sel, by)
        buckets = self._increases("training_step_duration_seconds_bucket", sel, by + ("le",))
        ranks: dict[tuple, dict] = {}
        for key, per_t in sorted(counts.items()):
            inst, host, rank_label, mode = key
            if not mode:
                continue
            row = ranks.setdefault(
                key[:3], {"rank": _rank_int(rank_label), "host": host, "instance": inst, "modes": {}}
            )
            times = sorted(t for t, n in per_t.items() if n > 0)
            names = sorted({k[4] for k in phases if k[:4] == key})
            le = sorted(((float(k[4]), k) for k in buckets if k[:4] == key), key=lambda x: (math.isinf(x[0]), x[0]))
            p50, p90 = (
                tuple(quantile(q, [(b, buckets[k].get(t, 0.0)) for b, k in le]) for t in times) for q in (0.5, 0.9)
            )
            row["modes"][mode] = Series(
                width=0,  # (windows of the query's step: ``wall_s``)
                t=tuple(t - self.step for t in times),
                wall_s=(float(self.step),) * len(times),
                steps=tuple(round(per_t[t]) for t in times),
                step_s=tuple(sums.get(key, {}).get(t, 0.0) for t in times),
                samples=tuple(round(samples.get(key, {}).get(t, 0.0)) for t in times),
                p50_s=p50,  # type: ignore[arg-type]  # (None where a window has no steps)
                p90_s=p90,  # type: ignore[arg-type]
                phases={n: tuple(phases[key + (n,)].get(t, 0.0) for t in times) for n in names},
                gpu_idle_s=tuple(idle[key].get(t, 0.0) for t in times) if key in idle else None,
            )
        rows = list(ranks.values())
        if len(rows) == 1 and rows[0]["rank"] is None:
            rows[0]["rank"] = 0
        series = tuple(RankSeries(rank=r["rank"], host=r["host"], modes=r["modes"]) for r in rows)
        return series, self._gpus(sel, hosts)

    def _gauge(self, q: str) -> tuple[GpuLine, ...]:
        out = []
        for r in self._range(q):
            labels = r["metric"]
            out.append(
                GpuLine(
                    host=labels.get("host_name", ""),
                    gpu=labels.get("gpu_index", "") or labels.get("hw_id", ""),
                    t=tuple(t for t, _ in r["values"]),
                    v=tuple(v for _, v in r["values"]),
                )
            )
        return tuple(sorted(out, key=lambda g: (g.host, g.gpu)))

    def _gpus(self, sel: str, hosts: list[str]) -> dict[str, tuple[GpuLine, ...]]:
        """GPU utilization (ratio) and memory used (bytes) per GPU over time."""
        by = "host_name, gpu_index, hw_id"
        out: dict[str, tuple[GpuLine, ...]] = {}
        sels = [sel]
        if hosts:  # sampled by a process outside the run (otel-training agent)
            sels.append('host_name=~"' + "|".join(h.replace('"', "") for h in hosts) + '"')
        for name, metric, fn in (
            ("utilization", "hw_gpu_utilization_ratio", "avg"),
            ("memory", "hw_gpu_memory_usage_bytes", "avg"),
        ):
            for s in sels:
                found = self._gauge(f"{fn} by ({by}) ({fn}_over_time({metric}{{{s}}}[{self.step}s]))")
                if found:
                    out[name] = found
                    break
        return out


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over one window's cumulative bucket counts."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower  # in the +Inf bucket: the highest finite bound
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def require(report: Report) -> None:
    """Charts need the time series: say what to do when the source has none."""
    if report.timeseries:
        return
    if report.source == SOURCE_SUMMARY:
        raise ReportError(
            "the summary file(s) hold no time series (written by an older otel-training): "
            "run again with this version to get charts"
        )
    raise ReportError("no training_step_duration_seconds series over time for this run in Prometheus")


def mode_names(report: Report) -> list[str]:
    """Modes with steps, train first."""
    return report.modes_with_steps()
