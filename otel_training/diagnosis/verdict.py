"""Turn a run summary into ranked findings: what holds the step, and what to do.

``diagnose(run)`` reads a run summary (:class:`Run`: each mode's phases with shares
of step time) and returns :class:`Finding` s, most important first. ``otel-training
report`` passes an :class:`Evidence` (evidence.py): the same modes with what it
measures elsewhere, the mean GPU utilization and each rank's own numbers
(:class:`RankTimes`, for straggler detection).

A finding's ``score`` is the share of step time it explains (0..1; what removing the
bottleneck could save at most), so findings from different causes rank together.
"""

from __future__ import annotations

from collections.abc import Mapping

from otel_training import semconv as sc
from otel_training.aggregate.run_model import Memory, Mode, Phase, Run, RunFacts
from otel_training.diagnosis.advice import compute_advice, host_to_device_advice, loader_advice
from otel_training.diagnosis.evidence import Evidence
from otel_training.diagnosis.finding import Finding
from otel_training.diagnosis.finding import pct as _pct
from otel_training.diagnosis.verdict_ranks import (
    communication_findings,
    rank_series,
    slowdown_findings,
    sync_wait_findings,
    waits_share,
)
from otel_training.diagnosis.verdict_ranks import straggler_findings as _straggler_findings

# A top-level phase must hold at least this share of step time to be a finding.
THRESHOLDS = {
    sc.PHASE_DATALOADER_NEXT: 0.15,
    sc.PHASE_TO_DEVICE: 0.10,
    sc.PHASE_FROM_DEVICE: 0.10,
    sc.PHASE_REDUCE_METRICS: 0.10,
    sc.PHASE_LR_SCHEDULERS: 0.05,
    sc.PHASE_UNTRACKED: 0.15,
    "user": 0.15,  # user phases and callback.* phases
}
COMPUTE_SHARE = 0.60  # train_batch/eval_batch above this: compute-bound
GPU_BUSY = 0.80  # mean GPU utilization above this: the GPU is the bottleneck
GPU_IDLE = 0.50  # mean GPU utilization below this: the GPU waits on the host
CALLBACK_PREFIX = "callback."

_BUILTIN = {
    sc.PHASE_DATALOADER_NEXT,
    sc.PHASE_TO_DEVICE,
    sc.PHASE_TRAIN_BATCH,
    sc.PHASE_EVAL_BATCH,
    sc.PHASE_LR_SCHEDULERS,
    sc.PHASE_FROM_DEVICE,
    sc.PHASE_REDUCE_METRICS,
    sc.PHASE_COMMUNICATION,
    sc.PHASE_UNTRACKED,
    *sc.BATCH_CHILDREN,
}


def pick_mode(modes: Mapping[str, Mode]) -> str | None:
    """The mode to diagnose: ``train`` when it has steps, else the busiest mode."""
    busy = {k: v for k, v in modes.items() if v.steps}
    if not busy:
        return None
    if sc.MODE_TRAIN in busy:
        return sc.MODE_TRAIN
    return max(busy, key=lambda m: busy[m].step_time_s or 0.0)


def _shares(mode: Mode) -> dict[tuple[str, str], Phase]:
    return {(p.parent, p.name): p for p in mode.phases}


def _callback_label(name: str) -> str:
    # callback.<Class>.<hook> -> "<Class>.<hook>"
    return name[len(CALLBACK_PREFIX) :]


def diagnose(subject: Run | Evidence) -> list[Finding]:
    """Ranked findings for a run or a report's evidence (never empty when a mode has steps)."""
    ev = Evidence.of_run(subject) if isinstance(subject, Run) else subject
    mode_name = pick_mode(ev.modes)
    if mode_name is None:
        return [
            Finding(
                "no_data",
                0.0,
                "no steps recorded",
                "the summary holds no completed step",
                ["check that the training loop iterates a torch DataLoader, or mark steps with otel_training.step()"],
            )
        ]
    mode = ev.modes[mode_name]
    phases = _shares(mode)
    top = {name: p for (parent, name), p in phases.items() if parent == "step"}
    share = {name: float(p.share or 0.0) for name, p in top.items()}
    step_time = float(mode.step_time_s or 0.0)
    gpu_mean = ev.gpu_mean
    where = f"of {mode_name} step time"
    facts = ev.facts  # what the run already does: advice leaves it out
    findings: list[Finding] = []

    # --- data loading --------------------------------------------------------------
    dl = share.get(sc.PHASE_DATALOADER_NEXT, 0.0)
    idle = mode.gpu_idle_s.get(sc.PHASE_DATALOADER_NEXT)
    if dl >= THRESHOLDS[sc.PHASE_DATALOADER_NEXT]:
        detail = f"waiting for the next batch (dataloader_next) is {_pct(dl)} {where}"
        if idle and step_time:
            detail += f"; the GPU sat idle while it waited: {_pct(idle / step_time)} {where}"
        findings.append(
            Finding(
                "data_loading",
                dl,
                "data-loading bound",
                detail,
                loader_advice(ev.loaders, facts),
                phase=sc.PHASE_DATALOADER_NEXT,
            )
        )

    # --- host <-> device copies ------------------------------------------------------
    td = share.get(sc.PHASE_TO_DEVICE, 0.0)
    if td >= THRESHOLDS[sc.PHASE_TO_DEVICE]:
        findings.append(
            Finding(
                "host_to_device",
                td,
                "host-to-device copies",
                f"moving the batch to the device (to_device) is {_pct(td)} {where}",
                host_to_device_advice(facts),
                phase=sc.PHASE_TO_DEVICE,
            )
        )
    fd = share.get(sc.PHASE_FROM_DEVICE, 0.0)
    if fd >= THRESHOLDS[sc.PHASE_FROM_DEVICE]:
        findings.append(
            Finding(
                "device_sync",
                fd,
                "device-to-host syncs",
                f".item()/.cpu()/.tolist() outside the model (from_device) is {_pct(fd)} {where}",
                [
                    "call .item() less often: accumulate losses/metrics on the device and read them every N steps",
                    "avoid .cpu()/.numpy() of large tensors in the loop; log summaries instead",
                ],
                phase=sc.PHASE_FROM_DEVICE,
            )
        )
    rm = share.get(sc.PHASE_REDUCE_METRICS, 0.0)
    if rm >= THRESHOLDS[sc.PHASE_REDUCE_METRICS]:
        findings.append(
            Finding(
                "metric_reduction",
                rm,
                "metric all-reduce",
                f"torch.distributed collectives in user code (reduce_metrics) are {_pct(rm)} {where}",
                [
                    "reduce metrics every N steps instead of every step",
                    "use async_op=True and wait where the value is needed",
                    "a slow collective often means another rank is late: see the per-rank spread",
                ],
                phase=sc.PHASE_REDUCE_METRICS,
            )
        )
    lr = share.get(sc.PHASE_LR_SCHEDULERS, 0.0)
    if lr >= THRESHOLDS[sc.PHASE_LR_SCHEDULERS]:
        findings.append(
            Finding(
                "lr_scheduler",
                lr,
                "slow LR scheduler",
                f"LRScheduler.step (step_lr_schedulers) is {_pct(lr)} {where}",
                ["check the scheduler for device syncs or per-step host work"],
                phase=sc.PHASE_LR_SCHEDULERS,
            )
        )

    # --- callbacks and user phases ---------------------------------------------------
    findings.extend(_callback_findings(phases, where))
    for name, s in share.items():
        if name in _BUILTIN or name.startswith(CALLBACK_PREFIX) or s < THRESHOLDS["user"]:
            continue
        findings.append(
            Finding(
                "user_phase",
                s,
                f"phase '{name}'",
                f"your phase '{name}' is {_pct(s)} {where}",
                [
                    f"make '{name}' asynchronous (a background thread or process) or run it every N steps",
                ],
                phase=name,
            )
        )
    un = share.get(sc.PHASE_UNTRACKED, 0.0)
    if un >= THRESHOLDS[sc.PHASE_UNTRACKED]:
        findings.append(
            Finding(
                "untracked",
                un,
                "untracked time",
                f"{_pct(un)} {where} is outside every known phase (logging, callbacks, "
                "checkpoints, host-side bookkeeping)",
                [
                    'wrap suspects in `with otel_training.phase("name"):` to name them',
                    "make logging / checkpointing asynchronous or less frequent",
                    "with Lightning or the HF Trainer, enable the integration to time each callback",
                ],
                phase=sc.PHASE_UNTRACKED,
            )
        )

    # --- compute ----------------------------------------------------------------------
    findings.extend(_compute_findings(share, phases, gpu_mean, where, mode_name, facts))

    # --- ranks and their waits ------------------------------------------------------------
    ranks = list(ev.ranks)
    findings.extend(_straggler_findings(ranks))
    findings.extend(communication_findings(ranks))
    findings.extend(slowdown_findings(rank_series(ev.timeseries, mode_name)))  # each rank against its own best
    if len(ranks) < 2:
        findings.extend(sync_wait_findings(phases, where))

    # --- GPU mostly idle without a dominant host phase ------------------------------
    if gpu_mean is not None and gpu_mean < GPU_IDLE and not findings:
        findings.append(
            Finding(
                "gpu_underused",
                1.0 - gpu_mean,
                "GPU under-used",
                f"mean GPU utilization is {_pct(gpu_mean)} with no dominant host phase",
                [
                    "raise the batch size, or use CUDA graphs / torch.compile to cut launch overhead",
                ],
            )
        )

    findings.sort(key=lambda f: f.score, reverse=True)
    if not findings:
        top3 = sorted(share.items(), key=lambda kv: kv[1], reverse=True)[:3]
        desc = ", ".join(f"{n} {_pct(s)}" for n, s in top3) or "no phases"
        findings.insert(
            0,
            Finding(
                "balanced",
                0.0,
                "balanced",
                f"no dominant bottleneck ({desc} {where})",
                [
                    "profile inside the largest phase (torch.profiler) for smaller gains",
                ],
            ),
        )
    for m in ev.memory:  # a summary's one, or a report's (one per rank)
        creep = memory_creep_finding(m.memory, m.rank)
        if creep is not None:  # not a share of step time: right after the top finding
            findings.insert(1, creep)
    tel = ev.telemetry
    lost = tel.spans_dropped + tel.steps_dropped + tel.export_failures
    if lost:
        findings.append(
            Finding(
                "telemetry_loss",
                0.0,
                "telemetry incomplete",
                f"{lost} spans/steps/exports were dropped or failed; traces may miss steps",
                ["check the Collector endpoint; raise OTEL_TRAINING_TRACE_EVERY_N"],
            )
        )
    return findings


def memory_creep_finding(memory: Memory | None, rank: int | None = None) -> Finding | None:
    """Memory at step ends that grows steadily over the run (the summary's
    ``memory.creep``, aggregate/memory.py): a leak, with its rate and likely causes."""
    creep = memory.creep if memory is not None else None
    if memory is None or creep is None:
        return None
    what = "device memory allocated to tensors" if memory.kind == "cuda" else "the process's resident memory"
    detail = (
        f"{what} at step ends grows {creep.mb_per_100_steps:.1f} MB per 100 steps "
        f"({creep.growth_bytes / 1e6:,.0f} MB from step {creep.from_step} to {creep.to_step}, "
        f"steadily: r² {creep.r2:.2f}); the run will run out of memory if it goes on long enough"
    )
    return Finding(
        "memory_creep",
        0.0,
        "memory creep",
        detail,
        [
            "look for tensors kept across steps: losses.append(loss) or total += loss keeps each "
            "step's tensor (and its autograd graph): append loss.item() or loss.detach() instead",
            "outputs, predictions or hidden states stored for metrics or logging: detach and move "
            "them to the CPU, or keep only running sums",
            "caches that grow with the run (dicts keyed by step or sample, lists never cleared)",
            "find it: torch.cuda.memory._record_memory_history() and a snapshot "
            "(pytorch.org/memory_viz) on CUDA, tracemalloc for host memory",
        ],
        rank=rank,
    )


def _callback_findings(phases: dict[tuple[str, str], Phase], where: str) -> list[Finding]:
    """One finding per callback class whose hooks together exceed the threshold."""
    per_class: dict[str, list[tuple]] = {}
    for (_parent, name), p in phases.items():
        if name.startswith(CALLBACK_PREFIX):
            cls = _callback_label(name).rsplit(".", 1)[0]
            per_class.setdefault(cls, []).append((float(p.share or 0.0), name))
    out = []
    for cls, items in per_class.items():
        total = sum(s for s, _ in items)
        if total < THRESHOLDS["user"]:
            continue
        items.sort(reverse=True)
        worst = _callback_label(items[0][1])
        out.append(
            Finding(
                "callback",
                total,
                f"slow callback {cls}",
                f"{worst} takes {_pct(items[0][0])} {where} ({cls} in all: {_pct(total)})",
                [
                    f"make {worst} asynchronous (hand the work to a background thread) or run it every N steps",
                    "log/checkpoint less often (e.g. log_every_n_steps, logging_steps, save_steps)",
                ],
                phase=items[0][1],
            )
        )
    return out


def _compute_findings(
    share: dict[str, float],
    phases: dict[tuple[str, str], Phase],
    gpu_mean: float | None,
    where: str,
    mode_name: str,
    facts: RunFacts | None,
) -> list[Finding]:
    batch = sc.PHASE_TRAIN_BATCH if mode_name == sc.MODE_TRAIN else sc.PHASE_EVAL_BATCH
    # Waiting for other ranks inside the batch (DDP's gradient sync) is no compute.
    tb = share.get(batch, 0.0) - waits_share(phases)
    if tb < COMPUTE_SHARE:
        return []
    kids = {name: float(p.share or 0.0) for (parent, name), p in phases.items() if parent == batch}
    inner = max(kids.items(), key=lambda kv: kv[1]) if kids else None
    inner_txt = f"; {inner[0]} is the largest part ({_pct(inner[1])} of {batch})" if inner else ""
    advice = compute_advice(facts, bool(inner and inner[0] == sc.PHASE_OPTIMIZER_STEP and inner[1] >= 0.3))
    if gpu_mean is None:
        return [
            Finding(
                "compute_bound", tb, "compute-bound", f"{batch} is {_pct(tb)} {where}{inner_txt}", advice, phase=batch
            )
        ]
    if gpu_mean >= GPU_BUSY:
        return [
            Finding(
                "gpu_bound",
                tb,
                "GPU-bound",
                f"{batch} is {_pct(tb)} {where} at {_pct(gpu_mean)} mean GPU utilization{inner_txt}",
                advice,
                phase=batch,
            )
        ]
    return [
        Finding(
            "launch_bound",
            tb,
            "compute phase with an idle GPU",
            f"{batch} is {_pct(tb)} {where} but the GPU is only {_pct(gpu_mean)} busy: "
            "the host cannot issue kernels fast enough",
            [
                "raise the batch size so each kernel does more work",
                "compile with torch.compile(model, mode='reduce-overhead') for CUDA graphs"
                if facts is not None and facts.compiled
                else "use torch.compile (mode='reduce-overhead' for CUDA graphs)",
                "look for host syncs or Python-heavy code inside forward/backward",
            ],
            phase=batch,
        )
    ]
