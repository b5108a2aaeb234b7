"""``otel-training report``'s text: each mode's phase table, GPU utilization, ranks,
memory, coverage, telemetry problems and the findings."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from otel_training import semconv as sc
from otel_training.aggregate.coverage import gap_place
from otel_training.aggregate.run_model import Mode, Phase
from otel_training.diagnosis.finding import Finding
from otel_training.diagnosis.findings_text import render_findings, self_check_lines
from otel_training.diagnosis.formatting import bar, ms, share_pct, table
from otel_training.diagnosis.goodput_text import report_lines
from otel_training.diagnosis.measures_text import compute_text, memory_text, named_text
from otel_training.diagnosis.profiles_text import profile_lines
from otel_training.diagnosis.verdict_ranks import own_work, slowest
from otel_training.diagnosis.words import plural, timing_words
from otel_training.report.model import SOURCE_SUMMARY, RankRow, Report, ReportMode


def by_size(pa: Mapping[str, Phase], pb: Mapping[str, Phase]) -> list[str]:
    """Phase names of two runs, the largest (ms per step in either) first."""

    def mean(phases: Mapping[str, Phase], name: str) -> float:
        p = phases.get(name)
        return p.mean_s if p is not None else 0.0

    return sorted(set(pa) | set(pb), key=lambda n: -max(mean(pa, n), mean(pb, n)))


def _ordered_phases(phases: Sequence[Phase]) -> list[tuple[Phase, int]]:
    """Top-level phases by share, each followed by its children (indented): ``(phase, depth)``."""
    top = sorted((p for p in phases if p.parent == sc.SPAN_STEP), key=lambda p: -p.share)
    out: list[tuple[Phase, int]] = []
    seen: set[int] = set()

    def add(p: Phase, depth: int) -> None:
        if id(p) in seen or depth > 4:
            return
        seen.add(id(p))
        out.append((p, depth))
        for c in sorted((c for c in phases if c.parent == p.name), key=lambda c: -c.share):
            add(c, depth + 1)

    for p in top:
        add(p, 0)
    out.extend((p, 1) for p in phases if id(p) not in seen)
    return out


def idle_share(m: Mode | ReportMode) -> float | None:
    """The GPU's idle time as a share of the mode's step time (None: not measured)."""
    return sum(m.gpu_idle_s.values()) / m.step_time_s if (m.step_time_s and m.gpu_idle_s) else None


def render_mode(mode: str, m: Mode | ReportMode) -> list[str]:
    """A mode's head line (counts, rates, step statistics), its phase table, compute and GPU idle time."""
    rates = f"{m.samples_per_s or 0.0:,.1f} samples/s"
    if m.tokens_per_s:
        rates += f", {m.tokens_per_s:,.0f} tokens/s"
    counts = f"{plural(m.steps, 'step')}, {plural(m.samples, 'sample')}"
    head = f"{mode}: {counts}, {rates}, step mean {ms(m.step_mean_s)} ms"
    stats = (("p50", m.step_p50_s), ("p90", m.step_p90_s), ("max", m.step_max_s))
    extra = [f"{k} {ms(v)}" for k, v in stats if v]
    if extra:
        head += f" ({', '.join(extra)} ms)"
    rows = []
    for p, depth in _ordered_phases(m.phases):
        rows.append(
            [
                "  " * depth + p.name,
                p.parent,
                f"{p.total_s:.2f}",
                ms(p.mean_s),
                share_pct(p.share),
                bar(p.share) if not depth else "",
            ]
        )
    lines = [head] + table(["phase", "parent", "total s", "ms/step", "share", ""], rows, {2, 3, 4})
    if m.flops is not None:
        lines.append("  " + compute_text(m.flops))
    idle = m.gpu_idle_s
    share = idle_share(m)
    if share is not None and m.step_time_s:
        parts = ", ".join(
            f"{k} {share_pct(v / m.step_time_s)}" for k, v in sorted(idle.items(), key=lambda kv: -kv[1])[:4]
        )
        lines.append(f"  GPU idle: {share_pct(share)} of step time ({parts})")
    return lines


def render_gpus(report: Report) -> list[str]:
    gpus = report.gpus
    if not gpus:
        if report.source == SOURCE_SUMMARY:
            return ["GPU utilization: not in summary files (use --prometheus for hw_gpu_utilization_ratio)"]
        return [
            "GPU utilization: no hw_gpu_utilization_ratio series for this run (no GPU, or the hardware sampler was off)"
        ]
    rows = [[g.host, g.index or g.gpu, g.model, share_pct(g.mean), share_pct(g.min)] for g in gpus]
    u = report.gpu_utilization
    lines = ["GPU utilization (hw_gpu_utilization_ratio):"] + table(
        ["host", "gpu", "model", "mean", "min"], rows, {3, 4}
    )
    if u is not None:
        lines.append(f"  all {len(gpus)} GPUs: mean {share_pct(u.mean)}, lowest {share_pct(u.min)}")
    return lines


def render_ranks(mode: str, rows: Sequence[RankRow], phases: list[str]) -> list[str]:
    if len(rows) < 2:
        return []
    waits = all(r.wait_mean_s is not None for r in rows)  # own work: the step minus the waits
    body = []
    for r in rows:
        wait = r.wait_mean_s or 0.0
        body.append(
            [
                str(r.rank if r.rank is not None else "?"),
                str(r.host or ""),
                f"{r.steps:,}",
                ms(r.step_mean_s),
            ]
            + ([ms(wait), ms(max(0.0, r.step_mean_s - wait))] if waits else [])
            + [f"{r.samples_per_s:,.1f}"]
            + [share_pct(r.phases.get(p, 0.0)) for p in phases]
        )
    extra = ["wait ms", "own ms"] if waits else []
    lines = [f"ranks ({mode}):"] + table(
        ["rank", "host", "steps", "step ms", *extra, "samples/s"] + phases,
        body,
        set(range(2, 5 + len(extra) + len(phases))),
    )
    times = [r.times() for r in rows]
    means = [t.step_mean_s for t in times if t.step_mean_s]
    if means:
        slow, ratio, _ = slowest(times, lambda t: t.step_mean_s or 0.0)
        lines.append(
            f"  spread: slowest rank {slow.rank} ({slow.host}) "
            f"{(slow.step_mean_s or 0.0) / min(means):.2f}x the fastest, "
            f"{ratio:.2f}x the others' median"
        )
    if waits:
        slow, ratio, _ = slowest(times, own_work)
        if ratio:
            lines.append(
                f"  own work (step minus waits in communication and reduce_metrics): most on rank "
                f"{slow.rank} ({slow.host}), {ratio:.2f}x the others' median"
            )
    return lines


def render_coverage(report: Report) -> list[str]:
    """Per rank, the share of the training loop inside steps; the self-check's findings."""
    lines = []
    ranks = report.coverages()
    for rank, c in ranks:
        who = f"rank {rank} " if len(ranks) > 1 and rank is not None else ""
        line = (
            f"coverage: {who}{share_pct(c.share)} of the training loop's {c.loop_s:.1f} s "
            "is inside steps" + named_text(c)
        )
        if c.gaps:
            line += (
                f"; {c.outside_s:.2f} s outside in {plural(c.gaps, 'gap')} (largest {c.largest_gap_s:.2f} s "
                f"{gap_place(c.largest_gap_after_step)})"
            )
        lines.append(line)
    for rank, f in report.checks():
        who = f" (rank {rank})" if len(ranks) > 1 and rank is not None else ""
        lines.extend(self_check_lines(f, "", who))
    return lines


def render(report: Report, findings: Sequence[Finding] | None = None, mode: str | None = None) -> str:
    """The report as text: ``findings`` and ``mode``, the report's own by default."""
    findings = report.findings or () if findings is None else findings
    mode = report.mode if mode is None else mode
    fmt = "%Y-%m-%d %H:%M:%S"
    rng = report.range
    when = ""
    if rng.start and rng.end:
        when = f", {time.strftime(fmt, time.localtime(rng.start))} .. {time.strftime(fmt, time.localtime(rng.end))}"
    src = (
        plural(len(report.files), "summary file")
        if report.source == SOURCE_SUMMARY
        else f"{report.prometheus} {report.selector}"
    )
    lines = [f"otel-training report: run {report.run} ({src}{when})"]
    timing = timing_words(report.timing, report.run_facts.device if report.run_facts is not None else None)
    if timing:
        lines[0] += f", {timing}"
    for name, m in report.modes.items():
        lines.append("")
        lines.extend(render_mode(name, m))
    lines.append("")
    lines.extend(render_gpus(report))
    if mode:
        top = [p.name for p in report.modes[mode].top_phases()][:3]
        rk = render_ranks(mode, report.rank_rows(mode), top)
        if rk:
            lines.append("")
            lines.extend(rk)
    mems = report.memories()
    for mem in mems:
        who = f"rank {mem.rank} " if len(mems) > 1 and mem.rank is not None else ""
        lines.append(f"{who}{memory_text(mem.memory)}")
    cover = render_coverage(report)
    if cover:
        lines.append("")
        lines.extend(cover)
    goodput = report_lines(  # the goodput bar
        report.jobs(), report.coverages(), report.run_facts, report.earlier_attempts
    )
    if goodput:
        lines.append("")
        lines.extend(goodput)
    profiles = profile_lines(report.profile_list())
    if profiles:
        lines.append("")
        lines.extend(profiles)
    tel = {k: v for k, v in report.telemetry.to_dict().items() if v}
    if tel:
        lines.append("")
        lines.append("telemetry problems: " + ", ".join(f"{k}={v}" for k, v in tel.items()))
    lines.append("")
    lines.extend(render_findings(findings))
    return "\n".join(lines)
