"""Findings about the whole process's wall time (the summary's ``job`` section,
aggregate/job.py): what keeps goodput down, and what to do.

A finding's ``score`` is the share of the wall time it explains (0..1): at most
what removing it could give back to training. Findings of the step time
(verdict.py) are shares of step time; these are listed apart from them.
"""

from __future__ import annotations

from otel_training.aggregate.run_model import Checkpoint, Coverage, Job, RunFacts, RunView
from otel_training.diagnosis.finding import Finding
from otel_training.diagnosis.finding import pct as _pct

# An activity must hold at least this share of the wall time to be a finding.
THRESHOLDS = {
    "checkpoint": 0.10,
    "startup": 0.20,  # start-up and compilation together
    "eval": 0.25,
    "other": 0.10,
    "named": 0.15,
    "slow_steps": 0.10,
    "restart": 0.10,  # restarts and lost progress, of the run's wall time over its attempts
}
BUILTIN = ("startup", "compile", "train", "eval", "checkpoint", "other", "shutdown")


def _s(x: float) -> str:
    return f"{x:.2f} s" if x < 10 else f"{x:,.0f} s"


SHORT_RUN_S = 600.0  # a run this short is a trial: its start-up share says little of a real run


def _startup_advice(job: Job, share: dict[str, float], wall: float, facts: RunFacts | None) -> list[str]:
    """What shortens start-up, for what this run does: compile caches only where it
    compiled, spawned DataLoader workers only where it has workers (each unknown: kept)."""
    advice = []
    if wall < SHORT_RUN_S:
        advice.append(
            f"a run this short ({_s(wall)}) spends much of its time starting: start-up (imports, model build) "
            "is paid once, so judge goodput on a run of real length"
        )
    comp = job.compile
    if comp is None or comp.compilations or share.get("compile", 0.0) >= 0.01:
        advice.append(
            "keep torch.compile's caches between runs: TORCHINDUCTOR_CACHE_DIR on a persistent disk "
            "(the FX graph and AOTAutograd caches reuse compiled code)"
        )
    # Every loader's workers re-import the script, an eval loader's too.
    loaders = facts.loaders if facts is not None else ()
    if not loaders or any(int(ld.num_workers or 0) > 0 for ld in loaders):
        advice.append(
            "spawned workers (DataLoader workers with the spawn start method, torch.multiprocessing.spawn) "
            're-import the training script: keep set-up under `if __name__ == "__main__":` and use '
            "persistent_workers=True"
        )
    advice.append(
        "index or preprocess the data set once and save the result (a cached index, pre-tokenized "
        "shards) instead of at every start"
    )
    return advice


def job_findings(job: Job | None, coverage: Coverage | None = None, facts: RunFacts | None = None) -> list[Finding]:
    """Ranked findings for a ``job`` section (empty without one); ``facts``: the
    summary's ``run`` section, where known, so advice leaves out what does not apply."""
    if job is None or not job.wall_s:
        return []
    wall = float(job.wall_s)
    act = {k: float(v or 0.0) for k, v in job.activities.items()}
    share = {k: v / wall for k, v in act.items()}
    where = f"of the {_s(wall)} wall time"
    out: list[Finding] = []

    ckpt = share.get("checkpoint", 0.0)
    if ckpt >= THRESHOLDS["checkpoint"]:
        c = job.checkpoint or Checkpoint()
        parts = []
        if c.saves:
            parts.append(f"{c.saves} saves {_s(c.save_s or 0.0)}")
        if c.loads:
            parts.append(f"{c.loads} loads {_s(c.load_s or 0.0)}")
        calls = ", ".join(x.name for x in c.calls[:3])
        detail = f"checkpoint saves and loads are {_pct(ckpt)} {where}"
        if parts:
            detail += f" ({', '.join(parts)}" + (f": {calls}" if calls else "") + ")"
        advice = [
            "save asynchronously: torch.distributed.checkpoint.async_save blocks training only while "
            "the state is staged in host memory; the write goes on in the background",
            "save less often (every N steps or epochs, and once at the end)",
            "write to a faster filesystem (local NVMe), and copy to network or object storage in the background",
        ]
        if (c.load_s or 0.0) > (c.save_s or 0.0):
            advice.insert(
                0, "resuming loads the checkpoint: load from local disk, with torch.load(mmap=True) or safetensors"
            )
        out.append(Finding("checkpoint_bound", ckpt, "checkpoint-bound", detail, advice))

    start = share.get("startup", 0.0) + share.get("compile", 0.0)
    if start >= THRESHOLDS["startup"]:
        detail = f"start-up (process start to the first step) is {_pct(share.get('startup', 0.0))} {where}"
        if share.get("compile", 0.0) >= 0.01:
            detail += f", torch.compile's compilation {_pct(share['compile'])}"
            if job.compile is not None and job.compile.recompilations:
                detail += f" ({job.compile.recompilations} recompilations)"
        advice = _startup_advice(job, share, wall, facts)
        out.append(Finding("startup_bound", start, "start-up-bound", detail, advice))

    ev = share.get("eval", 0.0)
    if ev >= THRESHOLDS["eval"]:
        out.append(
            Finding(
                "eval_bound",
                ev,
                "eval-bound",
                f"eval steps are {_pct(ev)} {where}, train steps {_pct(share.get('train', 0.0))}",
                [
                    "evaluate less often, or on a fixed subset of the validation set",
                    "raise the eval batch size: without gradients, larger batches fit",
                    "evaluate a saved checkpoint in a separate process or on another device while training goes on",
                ],
            )
        )

    other = share.get("other", 0.0)
    if other >= THRESHOLDS["other"]:
        detail = f"{_pct(other)} {where} lies between steps in no step, checkpoint or named phase"
        if coverage is not None and coverage.largest_gap_s:
            after = coverage.largest_gap_after_step
            place = f"after train step {after}" if after is not None else "before the first train step"
            detail += f" (largest gap {_s(float(coverage.largest_gap_s))} {place})"
        out.append(
            Finding(
                "other_bound",
                other,
                "other-between-steps-bound",
                detail,
                [
                    'name it: wrap that work in `with otel_training.phase("name"):` and it shows by name',
                    "make blocking work between epochs asynchronous (metric uploads, log flushes, "
                    "evaluation bookkeeping): hand it to a background thread",
                    "do it less often",
                ],
            )
        )

    for name in job.named:
        s = share.get(name, 0.0)
        if s >= THRESHOLDS["named"]:
            out.append(
                Finding(
                    "named_between",
                    s,
                    f"phase '{name}' between steps",
                    f"your phase '{name}' between steps is {_pct(s)} {where}",
                    [f"make '{name}' asynchronous (a background thread or process) or run it less often"],
                    phase=name,
                )
            )

    lost = float(job.slow_step_badput_s or 0.0) / wall
    if lost >= THRESHOLDS["slow_steps"] and job.ideal_step_s:
        out.append(
            Finding(
                "slow_steps",
                lost,
                "slow steps",
                f"{job.slow_steps or 0} train steps slower than the ideal "
                f"{float(job.ideal_step_s) * 1e3:.1f} ms lost {_pct(lost)} {where}",
                [
                    "look at the slowest steps' traces (tail capture keeps them): garbage collection, "
                    "a slow batch, a synchronization with another rank",
                ],
            )
        )
    restart = _restart_finding(job.run)
    if restart is not None:
        out.append(restart)
    out.sort(key=lambda f: f.score, reverse=True)
    return out


def _restart_finding(run: RunView | None) -> Finding | None:
    """Restart-bound: the time between a restarted run's attempts and the train steps
    a resumed attempt did again, as a share of the run's wall time."""
    if run is None or not run.wall_s:
        return None
    wall = float(run.wall_s)
    restart, lost = float(run.restart_s or 0.0), float(run.lost_progress_s or 0.0)
    share = (restart + lost) / wall
    if share < THRESHOLDS["restart"]:
        return None
    detail = (
        f"restarts ({_s(restart)}) and progress lost to resuming from an earlier checkpoint ({_s(lost)}) "
        f"are {_pct(share)} of the run's {_s(wall)} over {run.attempts} attempts"
    )
    advice = [
        "find why the attempt before failed: its rank's traceback (decorate main with "
        "torch.distributed.elastic.multiprocessing.errors.record for torchrun's error file)",
        "checkpoint more often, so a resume redoes less: torch.distributed.checkpoint.async_save keeps a save cheap",
        "restart faster: keep torch.compile's caches (TORCHINDUCTOR_CACHE_DIR) and data set indexes on a "
        "persistent disk",
    ]
    return Finding("restart_bound", share, "restart-bound", detail, advice)
