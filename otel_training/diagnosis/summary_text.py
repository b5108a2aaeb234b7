"""The run-end table printed at exit: each mode's phases, compute, memory, coverage,
the self-check and the verdict."""

from __future__ import annotations

from otel_training import semconv as sc
from otel_training.aggregate.run_model import Run
from otel_training.diagnosis.findings_text import self_check_lines, verdict_lines
from otel_training.diagnosis.goodput_text import summary_lines
from otel_training.diagnosis.measures_text import compute_text, coverage_line, memory_text
from otel_training.diagnosis.profiles_text import profile_lines
from otel_training.diagnosis.verdict import diagnose
from otel_training.diagnosis.words import plural


def render_summary(summary: Run | dict) -> str:
    """The run-end breakdown table(s) and a one-line verdict with advice."""
    run = summary if isinstance(summary, Run) else Run.from_dict(summary)
    lines = []
    for mode, m in run.modes.items():
        if not m.steps:
            continue
        rate = m.samples_per_s or 0.0  # over the mode's own step time
        head = f"otel-training: {mode} — {plural(m.steps, 'step')}"
        if (m.microbatches or 0) > m.steps:
            head += f" ({plural(m.microbatches or 0, 'micro-batch', 'micro-batches')})"
        if m.skipped_updates:
            head += f" ({plural(m.skipped_updates, 'update')} skipped)"
        head += f", mean step {m.step_mean_s * 1e3:.1f} ms"
        head += f" (p90 {(m.step_p90_s or 0.0) * 1e3:.1f} ms)"
        if rate:
            head += f", {rate:.0f} samples/s"
        if m.tokens_per_s:
            head += f", {m.tokens_per_s:,.0f} tokens/s"
        lines.append(head)
        if m.flops is not None:
            lines.append("  " + compute_text(m.flops))
        lines.append(f"  {'phase':<28}{'mean ms':>10}{'total s':>10}{'share':>8}")
        idle = m.gpu_idle_s
        top = [p for p in m.phases if p.parent == sc.SPAN_STEP]
        for p in top:
            label = p.name + ("*" if p.name == sc.PHASE_UNTRACKED else "")
            lines.append(f"  {label:<28}{p.mean_s * 1e3:>10.2f}{p.total_s:>10.2f}{p.share * 100:>7.1f}%")
            for c in m.phases:
                if c.parent == p.name:
                    lines.append(f"    {c.name:<26}{c.mean_s * 1e3:>10.2f}{c.total_s:>10.2f}{c.share * 100:>7.1f}%")
        if any(p.name == sc.PHASE_UNTRACKED for p in top):
            lines.append("  * untracked: time outside every phase (callbacks, logging, user code)")
        if idle and m.step_time_s:
            total_idle = sum(idle.values())
            worst = max(idle, key=lambda name: idle[name])
            lines.append(f"  GPU idle {total_idle / m.step_time_s * 100:.1f}% of step time (mostly during {worst})")
    if run.memory is not None:
        lines.append("  " + memory_text(run.memory))
    coverage = coverage_line(run.coverage)
    if coverage:
        lines.append(coverage)
    for finding in run.self_check or ():
        lines.extend(self_check_lines(finding, "  "))
    bad = {k: v for k, v in run.telemetry.to_dict().items() if v}
    if bad:
        lines.append("  telemetry problems: " + ", ".join(f"{k}={v}" for k, v in bad.items()))
    found = diagnose(run)
    if found:
        lines.extend(verdict_lines(found[0]))
    for f in found[1:]:
        if f.kind == "memory_creep":
            lines.append(f"{f.title}: {f.detail}")
            lines.extend(f"  - {a}" for a in f.advice[:2])
    lines.extend(summary_lines(run))  # the goodput bar
    if run.profiles is not None:
        lines.extend(profile_lines([(run.rank, p) for p in run.profiles.profiles]))
    return "\n".join(lines)
