"""Where a report's numbers come from: run-end summary files or Prometheus.

Both sources return the same *report* dict: the run-end summary's ``modes`` shape
(aggregated over ranks) plus ``ranks`` (per process, per mode), ``gpus`` (per GPU
utilization) and ``gpu_utilization`` (all GPUs). Failures raise :class:`ReportError`
with a one-line message.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from otel_training import semconv as sc
from otel_training.aggregate.run_model import SCHEMA, Mode, Run, SummaryError
from otel_training.diagnosis.verdict_ranks import own_work_parts


class ReportError(Exception):
    """A problem the user must fix (bad file, unreachable server, unknown run)."""


# ----------------------------------------------------------------------------- merging
def _new_mode() -> dict[str, Any]:
    return {
        "steps": 0,
        "samples": 0,
        "step_time_s": 0.0,
        "wall_s": 0.0,
        "throughput_sps": 0.0,
        "tokens": 0,
        "tokens_per_s": 0.0,
        "_phases": {},
        "_flops": [],
        "gpu_idle_s": {},
    }


def add_rank(
    modes: dict[str, dict],
    mode: str,
    steps: float,
    samples: float,
    step_time: float,
    phases: Iterable[tuple[str, str, float, float]],
    idle: dict[str, float],
    wall: float | None = None,
    tokens: float = 0.0,
    flops: dict | None = None,
    timed: dict | None = None,
) -> dict:
    """Add one rank's numbers for ``mode``; returns that rank's own mode row.
    ``flops``: the summary's ``flops`` section for this rank (per_step, flop_s, mfu...).
    Throughput is the samples (tokens) over the mode's own summed step time, never
    over ``wall`` (eval between training epochs spans whole epochs of training).
    ``timed``: a summary's ``timed_steps``, ``samples_per_s`` and ``tokens_per_s``,
    its statistics without the FLOP-count step."""
    agg: dict[str, Any] = modes.setdefault(mode, _new_mode())
    timed_steps = (timed or {}).get("timed_steps", steps)
    own: dict[str, Any] = {
        "steps": int(round(steps)),
        "samples": int(round(samples)),
        "step_time_s": step_time,
        "step_mean_s": step_time / timed_steps if timed_steps else 0.0,
        "phases": {},
        "phase_mean_s": {},
    }
    own["throughput_sps"] = samples / step_time if samples and step_time else 0.0
    own["tokens"] = int(round(tokens))
    own["tokens_per_s"] = tokens / step_time if tokens and step_time else 0.0
    if timed is not None:
        own["throughput_sps"] = timed.get("samples_per_s") or 0.0
        own["tokens_per_s"] = timed.get("tokens_per_s") or 0.0
    agg["_timed"] = agg.get("_timed", 0.0) + timed_steps
    agg["tokens"] += own["tokens"]
    agg["tokens_per_s"] += own["tokens_per_s"]
    if flops:
        own["flops"] = flops
        agg["_flops"].append(flops)
    agg["steps"] += own["steps"]
    agg["samples"] += own["samples"]
    agg["step_time_s"] += step_time
    agg["wall_s"] = max(agg["wall_s"], wall or step_time)
    agg["throughput_sps"] += own["throughput_sps"]
    for name, parent, total, count in phases:
        t, c = agg["_phases"].get((name, parent), (0.0, 0))
        agg["_phases"][(name, parent)] = (t + total, c + count)
        if parent == sc.SPAN_STEP and step_time:
            own["phases"][name] = total / step_time
            own["phase_mean_s"][name] = total / timed_steps if timed_steps else 0.0
    if timed_steps:  # own work and waits, seconds per step (diagnosis/verdict_ranks.py)
        own["wait_mean_s"], own["part_mean_s"] = own_work_parts(
            [(name, parent, total / timed_steps) for name, parent, total, _count in phases]
        )
    for name, secs in idle.items():
        agg["gpu_idle_s"][name] = agg["gpu_idle_s"].get(name, 0.0) + secs
    return own


def finish_modes(modes: dict[str, dict]) -> dict[str, dict]:
    """Turn accumulated totals into the summary's ``phases`` list with shares."""
    for m in modes.values():
        st, steps = m["step_time_s"], m.pop("_timed", m["steps"])  # the steps in the statistics
        m["step_mean_s"] = st / steps if steps else 0.0
        m["phases"] = [
            {
                "name": n,
                "parent": p,
                "total_s": t,
                "mean_s": t / steps if steps else 0.0,
                "count": int(round(c)),
                "share": t / st if st else 0.0,
            }
            for (n, p), (t, c) in sorted(m.pop("_phases").items(), key=lambda kv: -kv[1][0])
        ]
        idle = sum(m["gpu_idle_s"].values())
        m["gpu_idle_share"] = idle / st if (st and m["gpu_idle_s"]) else None
        ranks = m.pop("_flops")
        if ranks:  # all ranks together: FLOP/s and peaks add up, MFU is their mean
            mfus = [f["mfu"] for f in ranks if f.get("mfu") is not None]
            peaks = [f.get("peak_flop_s") for f in ranks]
            m["flops"] = {
                **ranks[0],
                "flop_s": sum(f.get("flop_s") or 0.0 for f in ranks),
                "peak_flop_s": sum(p for p in peaks if p) if all(peaks) else None,
                "mfu": sum(mfus) / len(mfus) if mfus else None,
            }
    return modes


# ----------------------------------------------------------------------- summary files
def read_summary(path: str) -> Run:
    """One validated run-end summary file."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ReportError(f"summary file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"cannot read summary file {path!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"summary file {path!r} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ReportError(
            f"{path!r} is not an otel-training run summary (expected schema "
            f"{SCHEMA!r}; write one with OTEL_TRAINING_SUMMARY_FILE)"
        )
    try:
        return Run.from_dict(data)
    except SummaryError as exc:
        raise ReportError(f"summary file {path!r} is malformed: {exc} (docs/summary-file.md)") from None


def summary_paths(arg: str) -> list[str]:
    """``a.json``, ``r0.json,r1.json`` or ``'run-*.json'`` (a glob the shell did not
    expand) -> file names. A name that exists is taken as it is, brackets and all."""
    out: list[str] = []
    for part in (p.strip() for p in arg.split(",")):
        if not part:
            continue
        pattern = any(ch in part for ch in "*?[") and not os.path.exists(part)
        found = sorted(glob.glob(part)) if pattern else [part]
        if not found:
            raise ReportError(f"no summary file matches {part!r}")
        out.extend(found)
    return out


def load_summaries(paths: list[str]) -> dict:
    """Merge one summary file per rank into a report (``paths``: names, lists or globs)."""
    names = [p for arg in paths for p in summary_paths(arg)]
    return merge_summaries([(p, read_summary(p)) for p in names])


def _one_run(files: list[tuple[str, Run]]) -> None:
    """Files of different runs are no ranks of one run: refuse to add them up. Ranks of
    one job carry one run id, except when started without torchrun (each process then
    has its own): files of distinct ranks of one world size pass as such ranks."""
    runs = {str(s.run_id) for _, s in files}
    if len(runs) < 2:
        return
    ranks = [s.rank for _, s in files]
    sizes = {s.world_size for _, s in files}
    if len(sizes) == 1 and (sizes.pop() or 1) > 1 and len(set(ranks)) == len(ranks):
        return
    listed = ", ".join(f"{p} (run {s.run_id}, rank {s.rank or 0})" for p, s in files)
    raise ReportError(
        f"summary files of {len(runs)} different runs: {listed}; report one run at a time "
        "(its ranks' files together), or compare two with otel-training compare A B"
    )


def _attempt(s: Run) -> int:
    attempt = s.job.attempt if s.job is not None else None
    return attempt.number if attempt is not None else 0


def latest_attempts(files: list[tuple[str, Run]]) -> tuple[list[tuple[str, Run]], list[str]]:
    """(the files to report, the earlier attempts' files left out): of a restarted
    run's rank, the last attempt's summary, whose ``job.run`` covers the attempts
    before it. Files of one rank that are no attempts of one another all stay."""
    by_rank: dict = {}
    for path, s in files:
        by_rank.setdefault((s.run_id, s.rank), []).append((path, s))
    kept: list[tuple[str, Run]] = []
    dropped: list[tuple[str, Run]] = []
    for group in by_rank.values():
        last = max(_attempt(s) for _, s in group)
        if last == 0 or sum(1 for _, s in group if _attempt(s) == last) > 1:
            kept.extend(group)
            continue
        for path, s in group:
            (kept if _attempt(s) == last else dropped).append((path, s))
    order = {path: i for i, (path, _) in enumerate(files)}
    return sorted(kept, key=lambda f: order[f[0]]), sorted((p for p, _ in dropped), key=order.__getitem__)


def merge_summaries(given: list[tuple[str, Run | dict]]) -> dict:
    """Merge run-end summaries (one per rank, each with its file name) into a report."""
    files = [(path, s if isinstance(s, Run) else Run.from_dict(s)) for path, s in given]
    seen: dict = {}
    for path, s in files:
        key = (s.run_id, s.rank, s.pid, s.host)
        if key in seen:
            raise ReportError(f"{path!r} and {seen[key]!r} are the same process's summary")
        seen[key] = path
    files, earlier = latest_attempts(files)
    _one_run(files)
    runs = sorted({str(s.run_id) for _, s in files})
    modes: dict[str, dict] = {}
    ranks: dict[str, list[dict]] = {}
    tel = {"spans_dropped": 0, "steps_dropped": 0, "export_failures": 0, "errors": 0}
    coverage: list[dict] = []
    checks: list[dict] = []
    memory: list[dict] = []
    jobs: list[dict] = []  # per rank, the wall time by activity (aggregate/job.py)
    ordered = sorted(files, key=lambda f: (f[1].rank or 0, f[0]))
    for path, s in ordered:
        who = {"rank": s.rank, "host": s.host}
        if s.job is not None:
            jobs.append({**who, **s.job.to_dict()})
        if s.coverage is not None and s.coverage.to_dict():
            coverage.append({**who, **s.coverage.to_dict()})
        if s.memory is not None and s.memory.to_dict():
            memory.append({**who, **s.memory.to_dict()})
        checks.extend({**who, **f.to_dict()} for f in s.self_check or ())
        for mode, m in s.modes.items():
            if not m.steps:
                continue
            own = add_rank(
                modes,
                mode,
                float(m.steps),
                float(m.samples),
                float(m.step_time_s),
                [(p.name, p.parent, float(p.total_s), float(p.count)) for p in m.phases],
                dict(m.gpu_idle_s),
                wall=float(m.wall_s) or None,
                tokens=float(m.tokens or 0),
                flops=m.flops.to_dict() if m.flops is not None else None,
                timed=_timed(m),
            )
            own.update(
                rank=s.rank,
                host=s.host,
                pid=s.pid,
                file=path,
                step_p50_s=m.step_p50_s,
                step_p90_s=m.step_p90_s,
                step_max_s=m.step_max_s,
            )
            ranks.setdefault(mode, []).append(own)
        for k, v in s.telemetry.to_dict().items():
            tel[k] += v
    first = files[0][1]
    for mode, rows in ranks.items():
        modes[mode]["step_max_s"] = max((r["step_max_s"] or 0.0) for r in rows)
        if len(rows) == 1:
            modes[mode].update(step_p50_s=rows[0]["step_p50_s"], step_p90_s=rows[0]["step_p90_s"])
    return {
        "source": "summary",
        "files": [p for p, _ in files],
        "earlier_attempts": earlier,  # a restarted rank's earlier summaries (its last one's job.run covers them)
        "service": first.service,
        "run": ", ".join(runs),
        "timing": first.timing,
        "world_size": first.world_size,
        "range": {
            "start": min(s.started_at or 0 for _, s in files),
            "end": max(s.ended_at or 0 for _, s in files),
        },
        "modes": finish_modes(modes),
        "ranks": ranks,
        "gpus": [],
        "gpu_utilization": None,
        "telemetry": tel,
        "coverage": coverage,
        "self_check": checks,
        "memory": memory,
        "job": jobs,
        # per rank, the run over time (aggregate/timeseries.py), for the HTML report
        "timeseries": [
            {"rank": s.rank, "host": s.host, "modes": {k: v.to_dict() for k, v in s.timeseries.items()}}
            for _, s in ordered
            if s.timeseries
        ],
        # what the run already does (the lowest rank's ``run`` section), for advice that fits it
        "run_facts": next((s.run.to_dict() for _, s in ordered if s.run is not None), None),
        "loaders": sorted({str(k) for _, s in files for k in s.loaders or ()}),
    }


def _timed(m: Mode) -> dict | None:
    """A mode's statistics without the FLOP-count step (None: a file from before they were)."""
    if m.timed_steps is None:
        return None
    return {"timed_steps": m.timed_steps, "samples_per_s": m.samples_per_s, "tokens_per_s": m.tokens_per_s}


# --------------------------------------------------------------------------- Prometheus
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)$")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``2h``, ``1d`` → seconds."""
    m = _DURATION.match(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ReportError(f"{text!r} is not a duration: use e.g. 30m, 2h, 1d")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def parse_time(text: str) -> float:
    """Unix seconds or ISO 8601 (``2025-01-31T12:00:00Z``) → unix seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ReportError(f"{text!r} is not a time: use unix seconds or ISO 8601") from None
    if dt.tzinfo is None:
        dt = dt.astimezone()
    return dt.timestamp()
