"""Rank findings: a straggler (the rank whose own work makes the others wait) and a
job whose ranks all wait on the network (communication-bound).

A rank's *own work* is its step minus its waits: ``communication`` (the exposed
gradient sync, record/grad_sync.py) and ``reduce_metrics`` (the user's collectives).
Ranks that synchronize take the same step time; the straggler is the one with the
most own work, named with the part of it that is larger than on the other ranks.

A rank (:class:`RankTimes`, from a report's rank rows, report/sources.py ``add_rank``)
carries ``step_mean_s``, ``phases`` (top-level shares), optionally ``phase_mean_s``
(top-level seconds per step) and, where the phase tree was known, ``wait_mean_s`` (its
waits, seconds per step) and ``part_mean_s`` (its own work by part: the batch's
children with their waits taken out, and the top-level phases).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from statistics import median

from otel_training import semconv as sc
from otel_training.aggregate.run_model import Phase, Series
from otel_training.diagnosis.evidence import RankSeries, RankTimes
from otel_training.diagnosis.finding import Finding, pct

STRAGGLER_RATIO = 1.15  # a rank's mean step (or own work) this much above the others' median
# ... and, for own work among synchronized ranks, the excess this share of its step at least
STRAGGLER_EXCESS = 0.2
COMMUNICATION_SHARE = 0.25  # every rank waits this share of its step: communication-bound

WAITS = (sc.PHASE_COMMUNICATION, sc.PHASE_REDUCE_METRICS)
_CONTAINERS = (sc.PHASE_TRAIN_BATCH, sc.PHASE_EVAL_BATCH)
_GUESSED_WAITS = (sc.PHASE_BACKWARD, sc.PHASE_REDUCE_METRICS)  # rows without the phase tree

COMMUNICATION_ADVICE = [
    "synchronize less often: accumulate gradients over several micro-batches and skip the "
    "all-reduce on all but the last (`with model.no_sync():` around the others' backward)",
    "larger gradient buckets overlap more of the all-reduce with backward: "
    "DistributedDataParallel(..., bucket_cap_mb=100) (default 25)",
    "send less: a compression comm hook, model.register_comm_hook(None, default_hooks.bf16_compress_hook) "
    "(or fp16_compress_hook, or PowerSGD from torch.distributed.algorithms.ddp_comm_hooks)",
    "check the network NCCL uses: NCCL_SOCKET_IFNAME / NCCL_IB_HCA set to the fastest interface "
    "(NCCL_DEBUG=INFO prints the one chosen)",
    "weak scaling: keep the batch per rank and grow the global batch with more ranks, so each "
    "rank computes longer per all-reduce",
]
_PART_ADVICE = {
    sc.PHASE_DATALOADER_NEXT: [
        "its input pipeline is slower: check its shard (sample count and sizes), the storage it reads "
        "from, and its DataLoader workers (CPU contention on its host)",
    ],
    sc.PHASE_TO_DEVICE: ["its host-to-device copies are slower: pin_memory=True, and check its PCIe/NUMA placement"],
    sc.PHASE_FORWARD: [
        "it computes more: uneven batches or sequence lengths across ranks (bucket or pack by length), "
        "a slower or throttled GPU (hw_gpu_throttle_ratio), CPU contention on its host",
    ],
    sc.PHASE_BACKWARD: [
        "its backward computes more: uneven batches or sequence lengths across ranks, a slower or "
        "throttled GPU (hw_gpu_throttle_ratio), gradient hooks or checkpointing only on this rank",
    ],
    sc.PHASE_OPTIMIZER_STEP: ["its optimizer step is slower: a throttled GPU, or optimizer state offloaded on it"],
    sc.PHASE_UNTRACKED: [
        "it does host work outside every phase that the others do not (logging, checkpoints or "
        'evaluation on one rank): wrap it in `with otel_training.phase("name"):` or move it off the step',
    ],
}


def _guessed_waits(rank: RankTimes) -> float:
    return sum(rank.phase_mean_s.get(p, 0.0) for p in _GUESSED_WAITS)


def own_work(rank: RankTimes) -> float:
    """Seconds per step of the rank's own work: its step minus its waits (a guess
    from top-level phases for rows without the phase tree: backward holds DDP's wait)."""
    waits = rank.wait_mean_s
    if waits is None:
        waits = _guessed_waits(rank)
    return max(0.0, (rank.step_mean_s or 0.0) - waits)


def own_work_parts(phases: list[tuple[str, str, float]]) -> tuple[float, dict[str, float]]:
    """``(waits, parts)`` from ``(name, parent, seconds per step)`` of every phase: the
    waits' seconds, and the own work by part (top-level phases and the batch's
    children, each without the waits inside it)."""
    waits = 0.0
    parts: dict[str, float] = {}
    inside: dict[str, float] = {}
    for name, parent, secs in phases:
        if name in WAITS:
            waits += secs
            inside[parent] = inside.get(parent, 0.0) + secs
        elif name not in _CONTAINERS and parent in (sc.SPAN_STEP, *_CONTAINERS):
            parts[name] = parts.get(name, 0.0) + secs
    for parent, secs in inside.items():
        if parent in parts:
            parts[parent] = max(0.0, parts[parent] - secs)
    return waits, parts


def slowest(ranks: Sequence[RankTimes], key: Callable[[RankTimes], float]) -> tuple[RankTimes, float, float]:
    """``(slowest rank, its key over the others' median, its excess over that median)``
    (a ratio of 0.0 where the median is 0); ``ranks``: two or more."""
    slow = max(ranks, key=key)
    med = median(key(r) for r in ranks if r is not slow)
    return slow, (key(slow) / med if med else 0.0), key(slow) - med


def _by_part(rank: RankTimes, field_: str) -> Mapping[str, float]:
    if field_ == "part_mean_s":
        return rank.part_mean_s or {}
    return rank.phase_mean_s if field_ == "phase_mean_s" else rank.phases


def _cause(slow: RankTimes, others: list[RankTimes]) -> tuple[str | None, float, str]:
    """The part of ``slow``'s work most above the others' median: (name, excess, field)."""
    field_ = next((f for f in ("part_mean_s", "phase_mean_s") if _by_part(slow, f)), "phases")
    diff_phase, diff = None, 0.0
    for name, v in _by_part(slow, field_).items():
        if name in WAITS:
            continue
        base = median([_by_part(r, field_).get(name, 0.0) for r in others])
        if v - base > diff:
            diff_phase, diff = name, v - base
    return diff_phase, diff, field_


def _step(rank: RankTimes) -> float:
    return rank.step_mean_s or 0.0


def straggler_findings(ranks: Sequence[RankTimes]) -> list[Finding]:
    timed = [r for r in ranks if r.step_mean_s]
    if len(timed) < 2:
        return []
    slow, ratio, excess = slowest(timed, _step)
    by_own = ratio < STRAGGLER_RATIO
    if by_own:
        # Synchronized ranks (DDP) all take the same step time: the straggler shows in
        # its own work, outside the phases where the others wait for it.
        slow, ratio, excess = slowest(timed, own_work)
        if ratio < STRAGGLER_RATIO or excess < STRAGGLER_EXCESS * _step(slow):
            return []
    others = [r for r in timed if r is not slow]
    diff_phase, diff, field_ = _cause(slow, others)
    where = f" on {slow.host}" if slow.host else ""
    detail = (
        f"rank {slow.rank}{where} averages {_step(slow) * 1e3:.1f} ms per "
        f"step ({own_work(slow) * 1e3:.1f} ms of its own work outside waits), {ratio:.2f}x the other ranks' "
        f"{'own work' if by_own else 'step'} median"
    )
    if diff_phase and field_ != "phases":
        detail += f"; its {diff_phase} takes {diff * 1e3:.1f} ms more per step than the others'"
        if by_own:
            detail += ", and the other ranks wait for it in their gradient sync and collectives"
    elif diff_phase:
        detail += f"; its {diff_phase} share is {pct(diff)} higher than the others'"
    advice = list(_PART_ADVICE.get(diff_phase or "", ()))
    advice += [
        f"inspect the agent{where}: CPU contention, a slower disk or network, GPU "
        "throttling (hw_gpu_throttle_ratio), other jobs on the machine",
        "check that data shards are balanced across ranks (same sample count and sizes)",
    ]
    return [
        Finding(
            "straggler",
            # the share of the step the others wait for it
            min(1.0, excess / _step(slow) if by_own else 1.0 - 1.0 / ratio),
            f"straggler rank {slow.rank}",
            detail,
            advice,
            phase=diff_phase,
            rank=slow.rank,
        )
    ]


def communication_findings(ranks: Sequence[RankTimes]) -> list[Finding]:
    """Every rank waits in its gradient sync and collectives: the network, not a straggler."""
    shares = [
        (r.wait_mean_s, r.wait_mean_s / r.step_mean_s) for r in ranks if r.step_mean_s and r.wait_mean_s is not None
    ]
    if len(shares) < 2 or len(shares) < len(ranks):
        return []
    least = min(share for _, share in shares)
    if least < COMMUNICATION_SHARE:
        return []
    mean_wait = sum(wait for wait, _ in shares) / len(shares)
    return [
        Finding(
            "communication_bound",
            least,
            "communication-bound",
            f"every rank waits in its gradient sync and collectives: {pct(least)} of its step at least "
            f"({mean_wait * 1e3:.1f} ms per step on average), with no rank slower than the others",
            list(COMMUNICATION_ADVICE),
            phase=sc.PHASE_COMMUNICATION,
        )
    ]


SLOWDOWN_RATIO = 1.3  # a rank's own work per step in the run's last part, over its best part
SLOWDOWN_EXCESS = 0.1  # ... by at least this share of its mean step
_PARTS = 4  # the run's windows (the first left out: warm-up) in this many parts


def _own_per_step(cols: Series) -> list[float]:
    """Own work per step in each window of a timeseries (aggregate/timeseries.py)."""
    steps, step_s = cols.steps, cols.step_s
    wait = cols.wait_s or (0.0,) * len(steps)
    return [(s - w) / n for n, s, w in zip(steps, step_s, wait) if n]


def rank_series(series: Sequence[RankSeries], mode: str) -> list[tuple[int | None, str | None, Series | None]]:
    """``(rank, host, windows)`` of each rank's timeseries for ``mode``."""
    return [(r.rank, r.host, r.modes.get(mode)) for r in series]


def slowdown_findings(series: list[tuple[int | None, str | None, Series | None]]) -> list[Finding]:
    """A rank against its own best: its own work per step in the last part of the run
    well above its best part (a GPU slowly throttling, a host filling up)."""
    out = []
    for rank, host, cols in series:
        if cols is None:
            continue
        own = _own_per_step(cols)[1:]
        if len(own) < 2 * _PARTS:
            continue
        size = len(own) // _PARTS
        parts = [median(own[i * size : (i + 1) * size]) for i in range(_PARTS - 1)] + [
            median(own[(_PARTS - 1) * size :])
        ]
        best, last = min(parts), parts[-1]
        steps = sum(cols.steps) or 1
        mean_step = sum(cols.step_s) / steps
        if best <= 0 or last < SLOWDOWN_RATIO * best or last - best < SLOWDOWN_EXCESS * mean_step:
            continue
        where = f" on {host}" if host else ""
        out.append(
            Finding(
                "rank_slowdown",
                min(1.0, (last - best) / last),
                f"rank {rank} slowing down" if rank is not None else "slowing down",
                f"{'rank ' + str(rank) if rank is not None else 'this rank'}{where}: its own work (the step minus "
                f"its waits) rose from {best * 1e3:.1f} ms per step, its best part of the run, to "
                f"{last * 1e3:.1f} ms in the last part ({last / best:.2f}x)",
                [
                    f"watch the GPU{where} over the run: clocks and throttling (hw_gpu_throttle_ratio), "
                    "temperature and power; a degrading GPU slows its rank, and in synchronized training, the job",
                    "check its host for work that grows with the run: other processes, memory pressure "
                    "(training_memory_* gauges), a cache or a log filling a disk",
                ],
                rank=rank,
            )
        )
    return out


def waits_share(phases: dict[tuple[str, str], Phase]) -> float:
    """The share of step time in ``communication`` (DDP's gradient sync, anywhere in the tree)."""
    return sum(float(p.share or 0.0) for (_parent, name), p in phases.items() if name == sc.PHASE_COMMUNICATION)


def sync_wait_findings(phases: dict[tuple[str, str], Phase], where: str) -> list[Finding]:
    """One rank's view (its own summary): it waits in the gradient sync, for the
    network or for a slower rank; the ranks' summaries together tell which."""
    comm = waits_share(phases)
    if comm < COMMUNICATION_SHARE:
        return []
    return [
        Finding(
            "sync_wait",
            comm,
            "waiting in gradient sync",
            f"the exposed gradient synchronization (communication) is {pct(comm)} {where}: the network, "
            "or a slower rank this one waits for",
            [
                "compare the ranks: otel-training report --summary summary-*.json names a straggler "
                "(the rank the others wait for) or says communication-bound",
                *COMMUNICATION_ADVICE,
            ],
            phase=sc.PHASE_COMMUNICATION,
        )
    ]
