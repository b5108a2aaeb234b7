"""Chart specs for the HTML report: a report's numbers and time series, merged over
ranks, as plain lists the page's script hands to uPlot (``assets/report.js``).

Ranks are merged on one time grid of at most ``MAX_POINTS`` bins (each window in
the bin holding its middle): step time per bin is the total over the total
(exact); p50/p90 are the step-weighted mean of the windows' own p50/p90 (exact for
one rank; for ranks in lockstep, their common value); shares are phase seconds
over step seconds; throughput adds each rank's samples over its own step time in
the bin (a mode's throughput counts only the time its steps ran). A mode's line
breaks where that mode did not run (another mode's bin between two of its own).
"""

from __future__ import annotations

from otel_training import semconv as sc
from otel_training.report.model import Report
from otel_training.report.series import MAX_POINTS, mode_names
from otel_training.report.text import by_size

_PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"]
_FIXED = {
    sc.PHASE_DATALOADER_NEXT: "#f28e2b",
    sc.PHASE_TRAIN_BATCH: "#4e79a7",
    sc.PHASE_EVAL_BATCH: "#4e79a7",
    sc.PHASE_TO_DEVICE: "#59a14f",
    sc.PHASE_FROM_DEVICE: "#e15759",
    sc.PHASE_REDUCE_METRICS: "#b07aa1",
    sc.PHASE_COMMUNICATION: "#ff9da7",
    sc.PHASE_LR_SCHEDULERS: "#9c755f",
    sc.PHASE_UNTRACKED: "#bab0ac",
    "other": "#79706e",
}
MODE_COLORS = {sc.MODE_TRAIN: "#4e79a7", sc.MODE_EVAL: "#59a14f"}
RUN_COLORS = ("#4e79a7", "#e15759")  # run A, run B


class Colors:
    """One color per phase name, the same in every chart of a page."""

    def __init__(self) -> None:
        self._given: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        if name in _FIXED:
            return _FIXED[name]
        if name not in self._given:
            free = [c for c in _PALETTE if c not in _FIXED.values()] + _PALETTE
            self._given[name] = free[len(self._given) % len(free)]
        return self._given[name]


def _t0(report: Report) -> float | None:
    starts = [cols.t[0] for r in report.timeseries or () for cols in r.modes.values() if cols.t]
    return min(starts) if starts else None


class Grid:
    """The common time grid of one run's ranks."""

    def __init__(self, report: Report) -> None:
        self.ranks = report.timeseries or ()
        self.t0 = _t0(report) or 0.0
        ends, counts = [], [0]
        for r in self.ranks:
            for cols in r.modes.values():
                if cols.t:
                    ends.append(cols.t[-1] + cols.wall_s[-1])
                    counts.append(len(cols.t))
        self.n = max(1, min(MAX_POINTS, max(counts)))
        self.width = max((max(ends) - self.t0) / self.n if ends else 1.0, 1e-9)

    def bin(self, t: float, wall: float) -> int:
        return max(0, min(self.n - 1, int((t + wall / 2 - self.t0) / self.width)))

    def x(self, b: int) -> float:
        return round((b + 0.5) * self.width, 3)

    def mode(self, mode: str) -> dict[int, dict]:
        """Per non-empty bin: sums over ranks (and per rank) of one mode's windows."""
        bins: dict[int, dict] = {}
        for i, r in enumerate(self.ranks):
            cols = r.modes.get(mode)
            if not cols:
                continue
            phases = cols.phases
            idle = cols.gpu_idle_s
            quantiles = (("p50", cols.p50_s), ("p90", cols.p90_s))
            for k, t in enumerate(cols.t):
                steps = cols.steps[k]
                if not steps:
                    continue
                acc = bins.setdefault(
                    self.bin(t, cols.wall_s[k]),
                    {"steps": 0, "step_s": 0.0, "p50": 0.0, "p90": 0.0, "q": 0, "phases": {}, "idle": 0.0, "rank": {}},
                )
                acc["steps"] += steps
                acc["step_s"] += cols.step_s[k]
                for q, column in quantiles:
                    v = column[k] if k < len(column) else None
                    if v is not None:
                        acc[q] += v * steps
                        acc["q"] += steps if q == "p50" else 0
                for name, values in phases.items():
                    acc["phases"][name] = acc["phases"].get(name, 0.0) + values[k]
                if idle:
                    acc["idle"] += idle[k]
                own = acc["rank"].setdefault(i, [0, 0.0, 0, 0.0])  # steps, step s, samples, wall s
                own[0] += steps
                own[1] += cols.step_s[k]
                own[2] += cols.samples[k]
                own[3] += cols.wall_s[k]
        return dict(sorted(bins.items()))


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 4)


def run_charts(report: Report, colors: Colors, prefix: str = "") -> list[dict]:
    """The charts of one run, in page order (only those with data)."""
    grid = Grid(report)
    modes = [m for m in mode_names(report) if any(m in r.modes for r in grid.ranks)]
    mode = report.mode or (modes[0] if modes else None)
    per_mode = {m: grid.mode(m) for m in modes}
    xs = sorted({b for bins in per_mode.values() for b in bins})
    charts: list[dict] = []
    xlabel = "seconds since the first step"
    if xs:
        breaks = {m: _breaks(m, xs, per_mode) for m in modes}
        series = []
        for m in modes:
            bins = per_mode[m]
            for q, dash in (("p50", None), ("p90", [6, 4])):
                values = [_ms(bins[b][q] / bins[b]["q"]) if b in bins and bins[b]["q"] else None for b in xs]
                if any(v is not None for v in values):
                    series.append(
                        {"label": f"{m} {q}", "values": values, "color": MODE_COLORS.get(m), "dash": dash, **breaks[m]}
                    )
        charts.append(_line(prefix + "step-time", "Step time (p50 / p90 per window)", xs, grid, series, "ms", xlabel))
        tput = []
        for m in modes:
            bins = per_mode[m]
            values = []
            for b in xs:
                rate = sum(own[2] / own[1] for own in bins[b]["rank"].values() if own[1]) if b in bins else None
                values.append(round(rate, 3) if rate is not None else None)
            if any(values):
                tput.append({"label": f"{m} samples/s", "values": values, "color": MODE_COLORS.get(m), **breaks[m]})
        if tput:
            charts.append(_line(prefix + "throughput", "Throughput", xs, grid, tput, "/s", xlabel))
    if mode and per_mode.get(mode):
        bins = per_mode[mode]
        mx = list(bins)
        totals: dict[str, float] = {}
        for acc in bins.values():
            for name, s in acc["phases"].items():
                totals[name] = totals.get(name, 0.0) + s
        names = sorted(totals, key=lambda n: -totals[n])
        shares = [
            {
                "label": n,
                "values": [round(100 * bins[b]["phases"].get(n, 0.0) / bins[b]["step_s"], 3) for b in mx],
                "color": colors(n),
            }
            for n in names
            if totals[n] > 0
        ]
        if shares:
            charts.append(
                dict(
                    _line(prefix + "phase-shares", f"Phase shares over time ({mode})", mx, grid, shares, "%", xlabel),
                    kind="area",
                )
            )
        if any(acc["idle"] for acc in bins.values()):
            idle = [
                {
                    "label": "GPU idle",
                    "values": [round(100 * bins[b]["idle"] / bins[b]["step_s"], 3) for b in mx],
                    "color": "#e15759",
                }
            ]
            charts.append(
                _line(prefix + "gpu-idle", f"GPU idle share of step time ({mode})", mx, grid, idle, "%", xlabel)
            )
    if mode:
        breakdown = _breakdown(prefix + "breakdown", report, mode, colors)
        if breakdown:
            charts.append(breakdown)
        charts.extend(_rank_charts(prefix, report, grid, per_mode.get(mode) or {}, mode, colors, xlabel))
    charts.extend(_gpu_charts(prefix, report, grid, xlabel))
    return charts


def _breaks(mode: str, xs: list[int], per_mode: dict[str, dict[int, dict]]) -> dict:
    """``{"breaks": [positions in xs]}`` where ``mode``'s line must break: bins between
    two of its own where another mode ran and it did not (eval passes between training
    epochs are not joined across the epochs). Other empty positions are spanned."""
    own = per_mode[mode]
    at = [k for k, b in enumerate(xs) if b in own]
    if len(at) < 2:
        return {}
    others = {b for m, bins in per_mode.items() if m != mode for b in bins}
    out = [k for k in range(at[0] + 1, at[-1]) if xs[k] not in own and xs[k] in others]
    return {"breaks": out} if out else {}


def _line(cid: str, title: str, bins: list[int], grid: Grid, series: list[dict], unit: str, xlabel: str) -> dict:
    return {
        "id": cid,
        "title": title,
        "kind": "line",
        "x": [grid.x(b) for b in bins],
        "xlabel": xlabel,
        "unit": unit,
        "series": series,
    }


def _breakdown(cid: str, report: Report, mode: str, colors: Colors) -> dict | None:
    phases = report.modes[mode].top_phases()
    if not phases:
        return None
    return {
        "id": cid,
        "title": f"Phase breakdown ({mode}, ms per step; share of step time in the legend)",
        "kind": "bars",
        "categories": [p.name for p in phases],
        "unit": "ms",
        "series": [
            {
                "label": "ms/step",
                "values": [_ms(p.mean_s) for p in phases],
                "color": "#4e79a7",
                "colors": [colors(p.name) for p in phases],
                "notes": [f"{100 * p.share:.1f}%" for p in phases],
            }
        ],
    }


def _rank_charts(
    prefix: str, report: Report, grid: Grid, bins: dict[int, dict], mode: str, colors: Colors, xlabel: str
) -> list[dict]:
    rows = report.rank_rows(mode)
    if len(rows) < 2:
        return []
    out: list[dict] = []
    names = [p.name for p in report.modes[mode].top_phases()]
    out.append(
        {
            "id": prefix + "rank-bars",
            "title": f"Per-rank step time ({mode}, ms per step by phase)",
            "kind": "stacked-bars",
            "categories": [f"rank {r.rank}" + (f" ({r.host})" if r.host else "") for r in rows],
            "unit": "ms",
            "series": [
                {
                    "label": n,
                    "color": colors(n),
                    "values": [_ms(r.phase_mean_s.get(n, 0.0)) for r in rows],
                }
                for n in names
            ],
        }
    )
    waits = [r.wait_mean_s for r in rows]
    if all(w is not None for w in waits):  # own work: the straggler has the most
        out.append(
            {
                "id": prefix + "rank-own",
                "title": f"Per-rank own work and waits ({mode}, ms per step)",
                "kind": "stacked-bars",
                "categories": out[0]["categories"],
                "unit": "ms",
                "series": [
                    {
                        "label": "own work",
                        "color": colors(sc.PHASE_TRAIN_BATCH),
                        "values": [_ms(max(0.0, r.step_mean_s - (r.wait_mean_s or 0.0))) for r in rows],
                    },
                    {
                        "label": "waiting for other ranks (communication, reduce_metrics)",
                        "color": colors(sc.PHASE_COMMUNICATION),
                        "values": [_ms(w) for w in waits],
                    },
                ],
            }
        )
    if bins and len(grid.ranks) >= 2:
        xs = list(bins)
        series = []
        labels = {i: f"rank {r.rank}" for i, r in enumerate(grid.ranks)}
        if len(grid.ranks) <= 8:
            for i in range(len(grid.ranks)):
                values = []
                for b in xs:
                    own = bins[b]["rank"].get(i)
                    values.append(_ms(own[1] / own[0]) if own and own[0] else None)
                series.append({"label": labels[i], "values": values, "color": _PALETTE[i % len(_PALETTE)]})
        else:  # many ranks: the fastest, the median and the slowest per window
            stats: dict[str, list] = {"fastest rank": [], "median rank": [], "slowest rank": []}
            for b in xs:
                means = sorted(own[1] / own[0] for own in bins[b]["rank"].values() if own[0])
                stats["fastest rank"].append(_ms(means[0]))
                stats["median rank"].append(_ms(means[len(means) // 2]))
                stats["slowest rank"].append(_ms(means[-1]))
            series = [{"label": k, "values": v, "color": _PALETTE[j]} for j, (k, v) in enumerate(stats.items())]
        out.append(_line(prefix + "rank-time", f"Mean step time per rank ({mode})", xs, grid, series, "ms", xlabel))
    return out


def _gpu_charts(prefix: str, report: Report, grid: Grid, xlabel: str) -> list[dict]:
    out = []
    gpus = report.gpu_series or {}
    for key, title, unit, scale in (
        ("utilization", "GPU utilization (hw_gpu_utilization_ratio)", "%", 100.0),
        ("memory", "GPU memory used (hw_gpu_memory_usage_bytes)", "GiB", 1 / 2**30),
    ):
        found = gpus.get(key) or ()
        if not found:
            continue
        xs = sorted({t for g in found for t in g.t})
        series = []
        for j, g in enumerate(found):
            at = dict(zip(g.t, g.v))
            series.append(
                {
                    "label": f"{g.host} gpu {g.gpu}",
                    "color": _PALETTE[j % len(_PALETTE)],
                    "values": [round(at[t] * scale, 4) if t in at else None for t in xs],
                }
            )
        out.append(
            {
                "id": prefix + "gpu-" + key,
                "title": title,
                "kind": "line",
                "unit": unit,
                "xlabel": xlabel,
                "x": [round(t - grid.t0, 3) for t in xs],
                "series": series,
            }
        )
    return out


def compare_charts(a: Report, b: Report, colors: Colors) -> list[dict]:
    """Run A against run B: phase ms/step side by side, and step time over each run."""
    mode = a.mode
    charts: list[dict] = []
    if mode and mode in a.modes and mode in b.modes:
        pa = {p.name: p for p in a.modes[mode].top_phases()}
        pb = {p.name: p for p in b.modes[mode].top_phases()}
        names = by_size(pa, pb)
        charts.append(
            {
                "id": "cmp-phases",
                "title": f"Phase time per step, A vs B ({mode}, ms)",
                "kind": "grouped-bars",
                "categories": names,
                "unit": "ms",
                "series": [
                    {
                        "label": label,
                        "color": RUN_COLORS[i],
                        "values": [_ms(src[n].mean_s if n in src else 0.0) for n in names],
                    }
                    for i, (label, src) in enumerate((("A", pa), ("B", pb)))
                ],
            }
        )
    lines: list[tuple[str, list[float], list]] = []
    for label, rep in (("A", a), ("B", b)):
        grid = Grid(rep)
        bins = grid.mode(mode) if mode else {}
        lines.append((label, [grid.x(k) for k in bins], [_ms(acc["step_s"] / acc["steps"]) for acc in bins.values()]))
    xs = sorted({v for _, got, _ in lines for v in got})
    if xs:
        series = []
        for i, (label, x, v) in enumerate(lines):
            at = dict(zip(x, v))
            series.append({"label": f"{label} mean step", "color": RUN_COLORS[i], "values": [at.get(t) for t in xs]})
        charts.append(
            {
                "id": "cmp-step-time",
                "title": f"Mean step time over each run ({mode}, ms)",
                "kind": "line",
                "unit": "ms",
                "xlabel": "seconds since each run's first step",
                "x": xs,
                "series": series,
            }
        )
    return charts
