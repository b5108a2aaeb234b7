"""The profiles a run recorded, as text lines (the run-end table, ``report``)."""

from __future__ import annotations

from collections.abc import Sequence

from otel_training.aggregate.run_sections import Profile

_WHY = {
    "slow": "a slow step",
    "periodic": "a slow step that recurs",
    "straggler": "this rank the straggler",
    "recompile": "a recompilation burst",
    "demand": "asked for by otel-training profile",
}


def _steps(p: Profile) -> str:
    if not p.steps:
        return "no step"
    mode = p.steps[0].mode
    numbers = [s.step for s in p.steps]
    span = str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]}"
    word = "step" if len(numbers) == 1 else "steps"
    ratios = [s.ratio for s in p.steps if s.ratio is not None]
    slow = "slow" if p.captured_slow else "not slow"
    at = f" ({max(ratios):.1f}x the median at most: {slow})" if ratios else ""
    return f"{mode} {word} {span}{at}"


def op_text(phase: str, share: float, name: str) -> str:
    """``forward: 71% aten::convolution``."""
    return f"{phase}: {share * 100:.0f}% {name}"


def profile_lines(profiles: Sequence[tuple[int | None, Profile]], indent: str = "  ") -> list[str]:
    """A heading and two lines per profile: why, what it recorded, its file; its top
    operators with their share of the phase they ran in."""
    if not profiles:
        return []
    ranks = {r for r, _ in profiles}
    lines = [f"profiles: {len(profiles)} recorded (torch.profiler, Chrome trace files for Perfetto UI)"]
    for rank, p in profiles:
        who = f"rank {rank}: " if len(ranks) > 1 and rank is not None else ""
        why = _WHY.get(p.trigger, p.trigger)
        if p.trigger_step is not None and p.ratio is not None:
            why += f", train step {p.trigger_step} at {p.ratio:.1f}x the median"
        elif p.trigger_step is not None:
            why += f", train step {p.trigger_step}"
        if p.period:
            why += f", every {p.period} steps"
        lines.append(f"{indent}{who}{p.trigger} ({why}): recorded {_steps(p)}")
        if p.error:
            lines.append(f"{indent}  not read: {p.error}")
        elif p.top:
            kind = "kernels" if p.device == "cuda" else "operators"
            tops = ", ".join(op_text(o.phase, o.phase_share, o.name) for o in p.top[:3])
            lines.append(f"{indent}  top {kind} by self time: {tops}")
        if p.note:
            lines.append(f"{indent}  {p.note}")
        if p.file:
            lines.append(f"{indent}  {p.file}")
    return lines
