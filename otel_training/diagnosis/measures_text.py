"""One line each for a run's coverage, compute (FLOPs, MFU) and memory."""

from __future__ import annotations

from otel_training.aggregate.coverage import gap_place
from otel_training.aggregate.run_model import Coverage, Flops, Memory
from otel_training.diagnosis.formatting import byte_size, si
from otel_training.diagnosis.words import plural


def coverage_line(cov: Coverage | None) -> str:
    """``coverage: 99.2% of the training loop's 12.3 s is inside steps; ...``."""
    if cov is None or not cov.loop_s:
        return ""
    line = f"  coverage: {cov.share * 100:.1f}% of the training loop's {cov.loop_s:.1f} s is inside steps"
    line += named_text(cov)
    if cov.gaps:
        line += (
            f"; outside: {cov.outside_s:.2f} s in {plural(cov.gaps, 'gap')}"
            f" (largest {cov.largest_gap_s:.2f} s {gap_place(cov.largest_gap_after_step)})"
        )
    if cov.before_first_step_s:
        line += f"; start-up {cov.before_first_step_s:.1f} s before the first step"
    return line


def named_text(cov: Coverage) -> str:
    """``, 12.0% in named phases between steps (checkpoint 2 × 0.41 s, save 0.30 s)``:
    the user's ``phase(name)`` with no step open, by name (empty without any)."""
    named = cov.named or ()
    if not named:
        return ""
    loop = cov.loop_s or 0.0
    share = f"{(cov.named_s or 0.0) / loop * 100:.1f}% " if loop > 0 else ""
    parts = [
        f"{n.name} {n.count} × {n.total_s / n.count:.2f} s" if n.count > 1 else f"{n.name} {n.total_s:.2f} s"
        for n in named[:6]
    ]
    more = f", {len(named) - 6} more" if len(named) > 6 else ""
    return f", {share}in named phases between steps ({', '.join(parts)}{more})"


def compute_text(f: Flops) -> str:
    """``compute: 1.51 GFLOP per step, 33.4 GFLOP/s, MFU 41.0% of ...``."""
    text = f"compute: {si(f.per_step, 'FLOP')} per step"
    if f.flop_s:
        text += f", {si(f.flop_s, 'FLOP/s')}"
    if f.mfu is not None:
        text += f", MFU {100 * f.mfu:.1f}%"
        if f.peak_flop_s:
            where = ", ".join(str(x) for x in (f.dtype, f.device) if x)
            text += f" of {si(f.peak_flop_s, 'FLOP/s')}" + (f" ({where})" if where else "")
    else:
        text += " (no peak known: OTEL_TRAINING_PEAK_FLOPS gives MFU)"
    if f.source == "measured":
        if f.counted_step is not None:
            text += f"; counted once on train step {f.counted_step}"
            if f.counted_step_s is not None:
                text += f" ({1e3 * f.counted_step_s:.0f} ms"
                if f.count_cost_s is not None:
                    text += f", +{1e3 * f.count_cost_s:.0f} ms"
                text += "), left out of the step times and throughput"
        elif f.count_cost_s is not None:
            text += f"; counted once, +{1e3 * f.count_cost_s:.0f} ms"
    return text


def memory_text(mem: Memory) -> str:
    """``memory: peak 12.3 GiB allocated ...`` (CUDA) or ``memory: RSS ...`` (CPU)."""
    if mem.kind == "cuda":
        text = (
            f"memory: peak {byte_size(mem.peak_allocated_bytes)} allocated, "
            f"{byte_size(mem.peak_reserved_bytes)} reserved per step; "
            f"{byte_size(mem.last_bytes)} allocated at the last step end"
        )
        if mem.device:
            text += f" ({mem.device})"
        return text + f"; {mem.alloc_retries or 0} allocator retries, {mem.ooms or 0} OOMs"
    text = f"memory: RSS {byte_size(mem.last_bytes)} at the last step end"
    return text + (f" ({byte_size(mem.first_bytes)} at the first)" if mem.first_bytes else "")
