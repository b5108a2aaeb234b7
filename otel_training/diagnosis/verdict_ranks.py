"""Straggler findings: a rank whose own work makes the others wait."""

from __future__ import annotations

from statistics import median

from otel_training.diagnosis.finding import Finding, pct

STRAGGLER_RATIO = 1.15  # a rank's mean step this much slower than the others' median

_WAITS = ("backward", "reduce_metrics")  # where synchronized ranks wait for each other


def _own_time(rank: dict) -> float:
    phases = rank.get("phase_mean_s") or {}
    return max(0.0, rank["step_mean_s"] - sum(phases.get(p, 0.0) for p in _WAITS))


def _slowest(ranks: list[dict], key) -> tuple:
    slow = max(ranks, key=key)
    med = median(key(r) for r in ranks if r is not slow)
    return slow, (key(slow) / med if med else 0.0)


def straggler_findings(ranks: list[dict]) -> list[Finding]:
    timed = [r for r in ranks if r.get("step_mean_s")]
    if len(timed) < 2:
        return []
    slow, ratio = _slowest(timed, lambda r: r["step_mean_s"])
    if ratio < STRAGGLER_RATIO:
        # Synchronized ranks (DDP) all take the same step time: the straggler shows in
        # its own time, outside the phases where the others wait for it.
        slow, ratio = _slowest(timed, _own_time)
        if ratio < STRAGGLER_RATIO:
            return []
    others = [r for r in timed if r is not slow]
    # Prefer absolute per-step seconds (phase_mean_s); shares shift when any phase grows.
    field_ = "phase_mean_s" if slow.get("phase_mean_s") else "phases"
    diff_phase, diff = None, 0.0
    for name, v in (slow.get(field_) or {}).items():
        base = median([(r.get(field_) or {}).get(name, 0.0) for r in others])
        if v - base > diff:
            diff_phase, diff = name, v - base
    where = f" on {slow['host']}" if slow.get("host") else ""
    detail = (
        f"rank {slow.get('rank')}{where} averages {slow['step_mean_s'] * 1e3:.1f} ms per "
        f"step ({_own_time(slow) * 1e3:.1f} ms outside waits), {ratio:.2f}x the other ranks' median"
    )
    if diff_phase and field_ == "phase_mean_s":
        detail += f"; its {diff_phase} takes {diff * 1e3:.1f} ms more per step than the others'"
    elif diff_phase:
        detail += f"; its {diff_phase} share is {pct(diff)} higher than the others'"
    return [
        Finding(
            "straggler",
            min(1.0, 1.0 - 1.0 / ratio),
            f"straggler rank {slow.get('rank')}",
            detail,
            [
                f"inspect the agent{where}: CPU contention, a slower disk or network, GPU "
                "throttling (hw_gpu_throttle_ratio), other jobs on the machine",
                "check that data shards are balanced across ranks (same sample count and sizes)",
            ],
            rank=slow.get("rank"),
        )
    ]
