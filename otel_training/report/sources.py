"""Where a report's numbers come from: run-end summary files or Prometheus.

Both sources return a :class:`~otel_training.report.model.Report`: the modes
aggregated over ranks, each rank's rows, GPU utilization and the ranks' sections.
Failures raise :class:`ReportError` with a one-line message.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from otel_training import semconv as sc
from otel_training.aggregate.run_model import SCHEMA, Flops, Mode, Phase, Run, SummaryError, Telemetry
from otel_training.diagnosis.evidence import RankSeries
from otel_training.diagnosis.verdict_ranks import own_work_parts
from otel_training.report.model import SOURCE_SUMMARY, Ranked, RankRow, Report, ReportMode, TimeRange, Who


class ReportError(Exception):
    """A problem the user must fix (bad file, unreachable server, unknown run)."""


# ----------------------------------------------------------------------------- merging
class ModeTotals:
    """One mode's numbers summed over the ranks added (:meth:`add_rank`), made a
    :class:`ReportMode` by :meth:`finish`."""

    def __init__(self) -> None:
        self.steps = 0
        self.samples = 0
        self.step_time_s = 0.0
        self.wall_s = 0.0
        self.samples_per_s = 0.0
        self.tokens = 0
        self.tokens_per_s = 0.0
        self.timed = 0.0  # the steps in the statistics (the FLOP-count step left out)
        self.phases: dict[tuple[str, str], tuple[float, float]] = {}
        self.flops: list[Flops] = []
        self.gpu_idle_s: dict[str, float] = {}
        self.step_max_s: float | None = None
        self.step_p50_s: float | None = None
        self.step_p90_s: float | None = None

    def add_rank(
        self,
        steps: float,
        samples: float,
        step_time: float,
        phases: Iterable[tuple[str, str, float, float]],
        idle: Mapping[str, float],
        wall: float | None = None,
        tokens: float = 0.0,
        flops: Flops | None = None,
        timed: Mode | None = None,
        **who: Any,
    ) -> RankRow:
        """Add one rank's numbers; returns that rank's own row (``who``: its rank, host, ...).
        Throughput is the samples (tokens) over the mode's own summed step time, never
        over ``wall`` (eval between training epochs spans whole epochs of training).
        ``timed``: the rank's summary mode, whose ``timed_steps``, ``samples_per_s``
        and ``tokens_per_s`` leave out the FLOP-count step (None: not known)."""
        phases = list(phases)
        timed_steps = timed.timed_steps if timed is not None and timed.timed_steps is not None else steps
        rate = samples / step_time if samples and step_time else 0.0
        token_rate = tokens / step_time if tokens and step_time else 0.0
        if timed is not None and timed.timed_steps is not None:
            rate, token_rate = timed.samples_per_s or 0.0, timed.tokens_per_s or 0.0
        shares, means = {}, {}
        for name, parent, total, count in phases:
            t, c = self.phases.get((name, parent), (0.0, 0))
            self.phases[(name, parent)] = (t + total, c + count)
            if parent == sc.SPAN_STEP and step_time:
                shares[name] = total / step_time
                means[name] = total / timed_steps if timed_steps else 0.0
        wait = parts = None
        if timed_steps:  # own work and waits, seconds per step (diagnosis/verdict_ranks.py)
            wait, parts = own_work_parts([(name, parent, total / timed_steps) for name, parent, total, _c in phases])
        own = RankRow(
            steps=int(round(steps)),
            samples=int(round(samples)),
            step_time_s=step_time,
            step_mean_s=step_time / timed_steps if timed_steps else 0.0,
            phases=shares,
            phase_mean_s=means,
            samples_per_s=rate,
            tokens=int(round(tokens)),
            tokens_per_s=token_rate,
            flops=flops,
            wait_mean_s=wait,
            part_mean_s=parts,
            **who,
        )
        self.timed += timed_steps
        self.tokens += own.tokens
        self.tokens_per_s += own.tokens_per_s
        if flops is not None:
            self.flops.append(flops)
        self.steps += own.steps
        self.samples += own.samples
        self.step_time_s += step_time
        self.wall_s = max(self.wall_s, wall or step_time)
        self.samples_per_s += own.samples_per_s
        for name, secs in idle.items():
            self.gpu_idle_s[name] = self.gpu_idle_s.get(name, 0.0) + secs
        return own

    def finish(self) -> ReportMode:
        """The mode: the phases with their shares, the largest first."""
        st, steps = self.step_time_s, self.timed
        phases = tuple(
            Phase(
                name=n,
                parent=p,
                total_s=t,
                mean_s=t / steps if steps else 0.0,
                count=int(round(c)),
                share=t / st if st else 0.0,
            )
            for (n, p), (t, c) in sorted(self.phases.items(), key=lambda kv: -kv[1][0])
        )
        idle = sum(self.gpu_idle_s.values())
        flops = None
        ranks = self.flops
        if ranks:  # all ranks together: FLOP/s and peaks add up, MFU is their mean
            mfus = [f.mfu for f in ranks if f.mfu is not None]
            peaks = [f.peak_flop_s for f in ranks]
            flops = replace(
                ranks[0],
                flop_s=sum(f.flop_s or 0.0 for f in ranks),
                peak_flop_s=sum(p for p in peaks if p) if all(peaks) else None,
                mfu=sum(mfus) / len(mfus) if mfus else None,
            )
        return ReportMode(
            steps=self.steps,
            samples=self.samples,
            step_time_s=st,
            wall_s=self.wall_s,
            samples_per_s=self.samples_per_s,
            tokens=self.tokens,
            tokens_per_s=self.tokens_per_s,
            gpu_idle_s=self.gpu_idle_s,
            step_mean_s=st / steps if steps else 0.0,
            phases=phases,
            gpu_idle_share=idle / st if (st and self.gpu_idle_s) else None,
            flops=flops,
            step_max_s=self.step_max_s,
            step_p50_s=self.step_p50_s,
            step_p90_s=self.step_p90_s,
        )


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


def load_summaries(paths: list[str]) -> Report:
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


def merge_summaries(given: list[tuple[str, Run | dict]]) -> Report:
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
    modes: dict[str, ModeTotals] = {}
    ranks: dict[str, list[RankRow]] = {}
    tel = [0, 0, 0, 0]
    coverage: list[Ranked] = []
    checks: list[Ranked] = []
    memory: list[Ranked] = []
    jobs: list[Ranked] = []  # per rank, the wall time by activity (aggregate/job.py)
    profiles: list[Ranked] = []  # each profile of each rank (docs/profiles.md)
    ordered = sorted(files, key=lambda f: (f[1].rank or 0, f[0]))
    for path, s in ordered:
        who = Who(s.rank, s.host)
        if s.job is not None:
            jobs.append(Ranked(who, s.job))
        if s.coverage is not None and s.coverage.to_dict():
            coverage.append(Ranked(who, s.coverage))
        if s.memory is not None and s.memory.to_dict():
            memory.append(Ranked(who, s.memory))
        checks.extend(Ranked(who, f) for f in s.self_check or ())
        if s.profiles is not None:
            profiles.extend(Ranked(who, p) for p in s.profiles.profiles)
        for mode, m in s.modes.items():
            if not m.steps:
                continue
            own = modes.setdefault(mode, ModeTotals()).add_rank(
                float(m.steps),
                float(m.samples),
                float(m.step_time_s),
                [(p.name, p.parent, float(p.total_s), float(p.count)) for p in m.phases],
                m.gpu_idle_s,
                wall=float(m.wall_s) or None,
                tokens=float(m.tokens or 0),
                flops=m.flops,
                timed=m,
                rank=s.rank,
                host=s.host,
                pid=s.pid,
                file=path,
                step_p50_s=m.step_p50_s,
                step_p90_s=m.step_p90_s,
                step_max_s=m.step_max_s,
            )
            ranks.setdefault(mode, []).append(own)
        t = s.telemetry
        for i, v in enumerate((t.spans_dropped, t.steps_dropped, t.export_failures, t.errors)):
            tel[i] += v
    first = files[0][1]
    for mode, rows in ranks.items():
        totals = modes[mode]
        totals.step_max_s = max((r.step_max_s or 0.0) for r in rows)
        if len(rows) == 1:
            totals.step_p50_s, totals.step_p90_s = rows[0].step_p50_s, rows[0].step_p90_s
    return Report(
        source=SOURCE_SUMMARY,
        files=tuple(p for p, _ in files),
        earlier_attempts=tuple(earlier),
        service=first.service,
        run=", ".join(runs),
        timing=first.timing,
        world_size=first.world_size,
        range=TimeRange(
            start=min(s.started_at or 0 for _, s in files),
            end=max(s.ended_at or 0 for _, s in files),
        ),
        modes={mode: totals.finish() for mode, totals in modes.items()},
        ranks={mode: tuple(rows) for mode, rows in ranks.items()},
        telemetry=Telemetry(spans_dropped=tel[0], steps_dropped=tel[1], export_failures=tel[2], errors=tel[3]),
        coverage=tuple(coverage),
        self_check=tuple(checks),
        memory=tuple(memory),
        job=tuple(jobs),
        profiles=tuple(profiles),
        # per rank, the run over time (aggregate/timeseries.py), for the HTML report
        timeseries=tuple(RankSeries(rank=s.rank, host=s.host, modes=s.timeseries) for _, s in ordered if s.timeseries),
        # what the run already does (the lowest rank's ``run`` section), for advice that fits it
        run_facts=next((s.run for _, s in ordered if s.run is not None), None),
        loaders=tuple(sorted({str(k) for _, s in files for k in s.loaders or ()})),
    )


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
