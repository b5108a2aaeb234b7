"""Two runs compared: per phase, step time, throughput and verdict, A vs B with deltas,
and an ``improvement``, ``regression`` or ``inconclusive`` judged against run-to-run
noise (``otel-training compare``, the HTML page's side-by-side section):

- each run's noise comes from the run itself: its windows of steps (the summary's
  time series, or Prometheus' windows), ranks merged, are cut into ``BLOCKS``
  consecutive blocks of about equal step count; the standard error of the run's
  mean is the block means' standard deviation over sqrt(blocks) (batch means:
  neighbouring steps are correlated, blocks much less);
- a change counts when it exceeds both ``Z`` times the two runs' combined standard
  error and a floor (default 5%): identical runs on one machine differ by a few
  percent (load, clocks, caches) that no single run's spread shows.

The step time is compared per step; when the batch size changed (samples per step
differ by more than 1%), per sample instead. :func:`gate` is the CI gate.
"""

from __future__ import annotations

import math
from statistics import stdev
from typing import Any

from otel_training.diagnosis.formatting import ms, share_pct, table
from otel_training.report.charts import Grid
from otel_training.report.comparison import (
    IMPROVEMENT,
    INCONCLUSIVE,
    REGRESSION,
    Comparison,
    Gate,
    PhaseJudged,
    Side,
    StepJudged,
    Throughput,
    Verdicts,
)
from otel_training.report.model import SOURCE_SUMMARY, Report
from otel_training.report.sources import ReportError
from otel_training.report.text import by_size

BLOCKS = 8
Z = 3.0
FLOOR = 0.05

__all__ = [
    "BLOCKS",
    "FLOOR",
    "IMPROVEMENT",
    "INCONCLUSIVE",
    "REGRESSION",
    "Z",
    "compare",
    "gate",
    "gate_line",
    "render",
]


def _blocks(report: Report, mode: str, value) -> list[float]:
    """``value(steps, step_s, samples, phases)`` per block of consecutive windows."""
    bins = list(Grid(report).mode(mode).values())
    total = sum(acc["steps"] for acc in bins)
    if len(bins) < 2 or not total:
        return []
    n = min(BLOCKS, len(bins))
    out: list[float] = []
    acc_steps = 0
    cur: dict[str, Any] = {"steps": 0, "step_s": 0.0, "samples": 0, "phases": {}}
    for acc in bins:
        cur["steps"] += acc["steps"]
        cur["step_s"] += acc["step_s"]
        cur["samples"] += sum(own[2] for own in acc["rank"].values())
        for name, s in acc["phases"].items():
            cur["phases"][name] = cur["phases"].get(name, 0.0) + s
        acc_steps += acc["steps"]
        if acc_steps >= (len(out) + 1) * total / n:
            v = value(cur["steps"], cur["step_s"], cur["samples"], cur["phases"])
            if v is not None:
                out.append(v)
            cur = {"steps": 0, "step_s": 0.0, "samples": 0, "phases": {}}
    return out


def _se(values: list[float]) -> float | None:
    return stdev(values) / math.sqrt(len(values)) if len(values) >= 2 else None


def _judge(a: float, b: float, se_a: float | None, se_b: float | None, floor: float, scale: float) -> dict:
    """Is b - a a change? ``scale`` is what the floor is a share of (A's value, or
    A's step time for a phase). Lower is better. (A :class:`Judged`'s fields.)"""
    delta = b - a
    noise = math.sqrt((se_a or 0.0) ** 2 + (se_b or 0.0) ** 2) if (se_a is not None and se_b is not None) else None
    threshold = max(floor * scale, Z * noise if noise is not None else 0.0)
    change = INCONCLUSIVE
    if abs(delta) > threshold:
        change = IMPROVEMENT if delta < 0 else REGRESSION
    return {
        "a": a,
        "b": b,
        "delta": delta,
        "delta_rel": delta / a if a else None,
        "noise": noise,
        "threshold": threshold,
        "change": change,
    }


def compare(a: Report, b: Report, mode: str | None = None, floor: float = FLOOR) -> Comparison:
    """The comparison of two reports (``report.build_report`` output, findings in)."""
    from otel_training.diagnosis.verdict import pick_mode

    mode = mode or pick_mode({name: m.as_mode() for name, m in a.modes.items()})
    if not mode or mode not in a.modes or mode not in b.modes:
        have_a, have_b = ", ".join(a.modes) or "none", ", ".join(b.modes) or "none"
        raise ReportError(f"nothing to compare: no {mode or 'common'} steps in both runs (A: {have_a}; B: {have_b})")
    ma, mb = a.modes[mode], b.modes[mode]
    spa = ma.samples / ma.steps if ma.steps else 0.0
    spb = mb.samples / mb.steps if mb.steps else 0.0
    per_sample = bool(spa and spb and abs(spb - spa) > 0.01 * spa)
    if per_sample:

        def unit(steps, step_s, samples, phases):
            return step_s / samples if samples else None

        va, vb = ma.step_time_s / ma.samples, mb.step_time_s / mb.samples
    else:

        def unit(steps, step_s, samples, phases):
            return step_s / steps if steps else None

        va, vb = ma.step_mean_s, mb.step_mean_s
    step = StepJudged(
        **_judge(va, vb, _se(_blocks(a, mode, unit)), _se(_blocks(b, mode, unit)), floor, va),
        per="sample" if per_sample else "step",
    )
    tput = Throughput(
        a=ma.samples_per_s,
        b=mb.samples_per_s,
        delta=mb.samples_per_s - ma.samples_per_s,
        delta_rel=(mb.samples_per_s - ma.samples_per_s) / ma.samples_per_s if ma.samples_per_s else None,
    )
    pa = {p.name: p for p in ma.top_phases()}
    pb = {p.name: p for p in mb.top_phases()}
    phases = []
    for name in by_size(pa, pb):

        def phase_unit(steps, step_s, samples, ph, name=name):
            return ph.get(name, 0.0) / steps if steps else None

        x, y = (p.mean_s if p is not None else 0.0 for p in (pa.get(name), pb.get(name)))
        j = _judge(x, y, _se(_blocks(a, mode, phase_unit)), _se(_blocks(b, mode, phase_unit)), floor, ma.step_mean_s)
        share_a, share_b = (p.share if p is not None else 0.0 for p in (pa.get(name), pb.get(name)))
        phases.append(PhaseJudged(**j, name=name, share_a=share_a, share_b=share_b))
    changed = None
    if step.change != INCONCLUSIVE:
        sign = -1 if step.change == IMPROVEMENT else 1
        moved = [p for p in phases if p.change == step.change]
        if moved:
            changed = max(moved, key=lambda p: sign * p.delta).name
    from otel_training.diagnosis.goodput_text import compare_job  # goodput A vs B

    return Comparison(
        job=compare_job([j.job for j in a.jobs()], [j.job for j in b.jobs()]),
        mode=mode,
        a=_side(a),
        b=_side(b),
        result=step.change,
        changed_phase=changed,
        step=step,
        throughput=tput,
        phases=tuple(phases),
        verdict=Verdicts(a=a.first_finding(), b=b.first_finding()),
        noise_model=f"batch means over {BLOCKS} blocks; a change exceeds {floor:.0%} of A "
        f"and {Z:g} x the combined standard error",
    )


def _side(report: Report) -> Side:
    where = report.files if report.source == SOURCE_SUMMARY else report.selector
    return Side(run=report.run, source=report.source, where=where, range=report.range)


def render(c: Comparison) -> str:
    """The comparison as text."""
    s, t = c.step, c.throughput
    per = "sample" if s.per == "sample" else "step"
    lines = [
        f"otel-training compare ({c.mode} steps)",
        f"  A: run {c.a.run} ({c.a.where_text()})",
        f"  B: run {c.b.run} ({c.b.where_text()})",
        "",
    ]
    rows = [
        [
            f"time per {per} ms",
            ms(s.a),
            ms(s.b),
            f"{s.delta * 1e3:+.1f} ms ({share_pct(s.delta_rel, sign=True)})",
            s.change,
        ],
        [
            "throughput samples/s",
            f"{t.a:,.1f}",
            f"{t.b:,.1f}",
            f"{t.delta:+,.1f} ({share_pct(t.delta_rel, sign=True)})",
            "",
        ],
    ]
    lines += table(["", "A", "B", "delta", ""], rows, {1, 2, 3})
    lines.append("")
    prow = [
        [
            p.name,
            ms(p.a),
            ms(p.b),
            f"{p.delta * 1e3:+.1f}",
            share_pct(p.share_a),
            share_pct(p.share_b),
            "" if p.change == INCONCLUSIVE else p.change,
        ]
        for p in c.phases
    ]
    lines += table(["phase", "A ms/step", "B ms/step", "delta ms", "A share", "B share", ""], prow, {1, 2, 3, 4, 5})
    lines.append("")
    for k, f in (("a", c.verdict.a), ("b", c.verdict.b)):
        lines.append(f"verdict {k.upper()}: " + (f"{f.title}: {f.detail}" if f else "no data"))
    from otel_training.diagnosis.goodput_text import compare_lines  # goodput A vs B

    lines.extend(compare_lines(c.job))
    lines.append("")
    noise = "unknown (runs too short)" if s.noise is None else f"±{share_pct(s.noise / s.a)}"
    delta = share_pct(s.delta_rel, sign=True)
    head = f"result: {c.result}: time per {per} {ms(s.a)} -> {ms(s.b)} ms ({delta}; "
    head += f"noise {noise}, threshold ±{share_pct(s.threshold / s.a)}"
    if c.result == INCONCLUSIVE:
        noisy = s.noise is not None and Z * s.noise >= s.threshold
        head += ": within the noise" if noisy else f": within the {share_pct(s.threshold / s.a)} floor"
    head += ")"
    moved = c.changed()
    if moved is not None:
        head += f"; {moved.name} changed most ({moved.delta * 1e3:+.1f} ms per step)"
    lines.append(head)
    if c.gate is not None:
        lines.append(gate_line(c.gate))
    return "\n".join(lines)


def gate(c: Comparison, max_regression_pct: float) -> Gate:
    """``--fail-on-regression PCT``: does B's step time fail the gate? It fails when it is
    worse than A's by more than PCT percent and by more than ``Z`` x the combined standard
    error (a change the runs' own noise explains does not fail a build); with the noise
    unknown (runs too short to measure it), PCT alone decides."""
    s = c.step
    allowed = max_regression_pct / 100 * s.a
    beyond_noise = s.noise is None or s.delta > Z * s.noise
    failed = bool(s.delta > allowed and beyond_noise)
    return Gate(
        max_regression_pct=max_regression_pct,
        delta_rel=s.delta_rel,
        noise_rel=s.noise / s.a if s.noise is not None and s.a else None,
        beyond_noise=bool(s.noise is not None and s.delta > Z * s.noise),
        failed=failed,
    )


def gate_line(g: Gate) -> str:
    """``gate: fail: ...`` / ``gate: pass: ...``, the CI gate's one line."""
    delta = f"time per step {share_pct(g.delta_rel, sign=True)}"
    noise = "noise unknown" if g.noise_rel is None else f"noise ±{share_pct(g.noise_rel)}"
    limit = f"{g.max_regression_pct:g}%"
    if g.failed:
        why = f"worse by more than the allowed {limit}" + (" and beyond the noise" if g.noise_rel is not None else "")
        return f"gate: fail: {delta} ({noise}): {why}"
    if (g.delta_rel or 0) * 100 > g.max_regression_pct:
        return f"gate: pass: {delta} ({noise}): over {limit} but within {Z:g} x the noise, not significant"
    return f"gate: pass: {delta} ({noise}): within the allowed {limit}"
