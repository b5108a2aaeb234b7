"""The goodput bar: the whole process's wall time by activity (the summary's ``job``
section, aggregate/job.py) as text for the run-end table, ``otel-training report``
and ``compare``, and as HTML for the report page."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from otel_training.aggregate.run_model import Checkpoint, Compile, Coverage, Job, Run, RunFacts, RunView
from otel_training.aggregate.run_sections import _Section
from otel_training.diagnosis.evidence import RankJob
from otel_training.diagnosis.goodput_findings import job_findings
from otel_training.diagnosis.words import plural

WIDTH = 40
# One character per activity in the bar, in the order shown; a user's named phase: "N".
SYMBOLS = {
    "restart": "R",  # a restarted run: between its attempts
    "startup": "S",
    "compile": "C",
    "train": "#",
    "lost_progress": "x",  # train steps a resumed attempt did again
    "eval": "E",
    "checkpoint": "K",
    "other": ".",
    "shutdown": "s",
}
NAMED = "N"
# The page's colours per activity (named phases: NAMED_COLOR).
COLORS = {
    "restart": "#c62828",
    "startup": "#9e9e9e",
    "compile": "#8e24aa",
    "train": "#2e7d32",
    "lost_progress": "#ef9a9a",
    "eval": "#1565c0",
    "checkpoint": "#ef6c00",
    "other": "#d7ccc8",
    "shutdown": "#616161",
}
NAMED_COLOR = "#f9a825"


def _ordered(job: Job | RunView) -> list[tuple[str, float]]:
    """(activity, seconds) with time in it: ours in a fixed order, named phases before other."""
    act = job.activities
    named = [k for k in act if k not in SYMBOLS]
    order = [
        "restart",
        "startup",
        "compile",
        "train",
        "lost_progress",
        "eval",
        "checkpoint",
        *named,
        "other",
        "shutdown",
    ]
    return [(k, float(act[k])) for k in order if float(act.get(k) or 0.0) > 0]


def bar(job: Job | RunView, width: int = WIDTH) -> str:
    """``[SSSSSSSSSS####EEK....s]``: each activity's share of the wall time, an activity
    of at least a 40th always visible (largest remainders fill the rest)."""
    items = _ordered(job)
    total = sum(s for _, s in items)
    if total <= 0:
        return "[" + " " * width + "]"
    raw = [s / total * width for _, s in items]
    cells = [int(x) for x in raw]
    for i, x in enumerate(raw):
        if cells[i] == 0 and x >= 0.5:
            cells[i] = 1
    while sum(cells) > width:
        i = max(range(len(cells)), key=lambda j: cells[j])
        cells[i] -= 1
    for i in sorted(range(len(raw)), key=lambda j: raw[j] - int(raw[j]), reverse=True):
        if sum(cells) >= width:
            break
        cells[i] += 1
    return "[" + "".join(SYMBOLS.get(k, NAMED) * n for (k, _), n in zip(items, cells)) + "]"


def legend(job: Job | RunView) -> str:
    """``S startup 4.6 s 63%, # train 0.73 s 10%, ...``."""
    wall = float(job.wall_s or 0.0)
    parts = []
    for k, s in _ordered(job):
        if s < 0.005 and (wall <= 0 or s / wall < 0.005):
            continue  # (neither its seconds nor its share would show)
        share = f" {100 * s / wall:.0f}%" if wall > 0 else ""
        parts.append(f"{SYMBOLS.get(k, NAMED)} {k} {_s(s)}{share}")
    return ", ".join(parts)


def _s(x: float) -> str:
    return f"{x:.2f} s" if x < 10 else f"{x:,.0f} s"


def goodput_lines(job: Job, indent: str = "  ", who: str = "") -> list[str]:
    """The goodput line, the bar with its legend, and what the run's checkpoints and
    compilations were."""
    wall = float(job.wall_s or 0.0)
    goodput = float(job.goodput or 0.0)
    train = float(job.activities.get("train") or 0.0)
    head = f"{indent}goodput{who}: {100 * goodput:.1f}% of the {_s(wall)} wall time in train steps ({_s(train)})"
    if job.ideal_step_s:
        head += f"; ideal train step {float(job.ideal_step_s) * 1e3:.1f} ms"
        if job.slow_step_badput_s:
            head += f", {plural(int(job.slow_steps or 0), 'slower step')} lost {_s(job.slow_step_badput_s)}"
    lines = [head, f"{indent}  {bar(job)}", f"{indent}  {legend(job)}"]
    extra = []
    c = job.checkpoint or Checkpoint()
    if c.saves or c.loads:
        calls = ", ".join(x.name for x in c.calls[:3])
        part = []
        if c.saves:
            part.append(f"{plural(c.saves, 'save')} {_s(c.save_s or 0.0)}")
        if c.loads:
            part.append(f"{plural(c.loads, 'load')} {_s(c.load_s or 0.0)}")
        extra.append(f"checkpoints: {', '.join(part)}" + (f" ({calls})" if calls else ""))
    comp = job.compile or Compile()
    if comp.compilations:
        text = f"torch.compile: {plural(comp.compilations, 'compilation')}"
        if comp.recompilations:
            where = ", ".join(f"{r.mode} step {r.step}" for r in comp.recompiled_at[:5])
            text += f", {plural(comp.recompilations, 'recompilation')}" + (f" (at {where})" if where else "")
        extra.append(text)
    if extra:
        lines.append(f"{indent}  " + "; ".join(extra))
    return lines + attempt_lines(job, indent)


def attempt_lines(job: Job, indent: str = "  ") -> list[str]:
    """A restarted run: this attempt's restart and lost progress, and the run's goodput
    over its attempts with its bar."""
    attempt, run = job.attempt, job.run
    if attempt is None or run is None:
        return []
    n = int(attempt.number or 0)
    text = (
        f"{indent}restart: attempt {n + 1} of this run began {_s(float(attempt.restart_s or 0.0))} "
        f"after attempt {n} ended ({attempt.previous_exit})"
    )
    if attempt.lost_steps:
        text += (
            f"; resumed at global step {attempt.resumed_at_step}: "
            f"{plural(int(attempt.lost_steps), 'step')} of attempt {n} "
            f"({_s(float(attempt.lost_progress_s or 0.0))} of train time) done again"
        )
    elif attempt.resumed_at_step is not None:
        text += f"; resumed at global step {attempt.resumed_at_step}, no progress lost"
    wall = float(run.wall_s or 0.0)
    head = (
        f"{indent}run goodput over {run.attempts} attempts: {100 * float(run.goodput or 0.0):.1f}% "
        f"of {_s(wall)} (restarts {_s(float(run.restart_s or 0.0))}, lost progress "
        f"{_s(float(run.lost_progress_s or 0.0))})"
    )
    return [text, head, f"{indent}  {bar(run)}", f"{indent}  {legend(run)}"]


def run_goodput(job: Job) -> float:
    """A rank's goodput: over the run's attempts where it restarted, else its process's."""
    return float((job.run or job).goodput or 0.0)


def finding_lines(
    job: Job, coverage: Coverage | None = None, advice: int = 3, indent: str = "", facts: RunFacts | None = None
) -> list[str]:
    """The top finding about the wall time, with its advice (none below the thresholds)."""
    found = job_findings(job, coverage, facts)
    if not found:
        return []
    f = found[0]
    return [f"{indent}goodput: {f.title} ({f.detail})"] + [f"{indent}  - {a}" for a in f.advice[:advice]]


def summary_lines(run: Run) -> list[str]:
    """The run-end table's goodput lines (none before the first step)."""
    if run.job is None:
        return []
    return goodput_lines(run.job) + finding_lines(run.job, run.coverage, facts=run.run)


def report_lines(
    ranks: Sequence[RankJob],
    coverage: Sequence[tuple[int | None, Coverage]] = (),
    facts: RunFacts | None = None,
    earlier: Sequence[str] = (),
) -> list[str]:
    """``otel-training report``: each rank's goodput bar, the job's goodput (the mean over
    ranks), and the findings of the rank with the lowest goodput (``coverage``: by
    rank; ``earlier``: the files of earlier attempts left out)."""
    jobs = [j for j in ranks if j.job.wall_s]
    if not jobs:
        return []
    lines = []
    for j in jobs:
        who = f" (rank {j.rank})" if len(jobs) > 1 and j.rank is not None else ""
        lines.extend(goodput_lines(j.job, "", who))
    if earlier:
        lines.append(
            f"earlier attempts left out ({', '.join(earlier)}): each restarted rank's last summary "
            "covers them in its run line"
        )
    if len(jobs) > 1:
        mean = sum(run_goodput(j.job) for j in jobs) / len(jobs)
        over = ", over the run's attempts" if any(j.job.run is not None for j in jobs) else ""
        lines.append(f"job goodput: {100 * mean:.1f}% (mean over {len(jobs)} ranks{over})")
    worst = min(jobs, key=lambda j: run_goodput(j.job))
    its = next((c for rank, c in coverage if rank == worst.rank), None)
    for f in job_findings(worst.job, its, facts)[:3]:
        lines.append(f"goodput: [{f.severity}] {f.title} ({100 * f.score:.0f}% of the wall time)")
        lines.append(f"  {f.detail}")
        lines.extend(f"  - {a}" for a in f.advice)
    return lines


def job_html(ranks: Sequence[RankJob]) -> str:
    """The report page's goodput bars (one per rank) and legend."""
    rows = [r for r in ranks if r.job.wall_s]
    if not rows:
        return ""
    out = ["<h3>Goodput: the wall time by activity</h3>"]
    for r in rows:
        j = r.job
        wall = float(j.wall_s)
        who = f"rank {r.rank}: " if len(rows) > 1 and r.rank is not None else ""
        segments = "".join(
            f'<span title="{_e(k)} {_e(_s(s))} ({100 * s / wall:.1f}%)" '
            f'style="display:inline-block;height:1.2em;width:{100 * s / wall:.3f}%;'
            f'background:{COLORS.get(k, NAMED_COLOR)}"></span>'
            for k, s in _ordered(j)
        )
        run = j.run
        over = (
            f"; over the run's {run.attempts} attempts {100 * run_goodput(j):.1f}% "
            f"(restarts {_e(_s(float(run.restart_s or 0.0)))}, lost progress "
            f"{_e(_s(float(run.lost_progress_s or 0.0)))})"
            if run is not None
            else ""
        )
        out.append(
            f'<p class="meta">{_e(who)}goodput {100 * float(j.goodput or 0.0):.1f}% of {_e(_s(wall))}{over}</p>'
            f'<div class="goodput" style="width:100%;white-space:nowrap;overflow:hidden;'
            f'border:1px solid #ccc;line-height:0">{segments}</div>'
        )
    keys = [k for k, _ in _ordered(rows[0].job)]
    out.append(
        '<p class="meta">'
        + " ".join(
            f'<span style="display:inline-block;width:0.8em;height:0.8em;background:{COLORS.get(k, NAMED_COLOR)}">'
            f"</span> {_e(k)}"
            for k in keys
        )
        + "</p>"
    )
    return "".join(out)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


# -- compare ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class GoodputPair(_Section):
    a: float
    b: float
    delta: float


@dataclass(frozen=True, slots=True, kw_only=True)
class WallPair(_Section):
    a: float
    b: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivityPair(_Section):
    name: str
    a: float
    b: float


@dataclass(frozen=True, slots=True, kw_only=True)
class JobComparison(_Section):
    """Goodput, wall time and seconds per activity of two runs' jobs."""

    goodput: GoodputPair
    wall_s: WallPair
    activities: tuple[ActivityPair, ...] = ()


def compare_job(a: Sequence[Job], b: Sequence[Job]) -> JobComparison | None:
    """Goodput and seconds per activity of two reports' jobs (each the mean over its
    ranks, a restarted rank's over its attempts); None unless both have a ``job`` section."""
    ja, jb = _mean_job(a), _mean_job(b)
    if ja is None or jb is None:
        return None
    names = [k for k, _ in _ordered(ja)] + [k for k, _ in _ordered(jb) if k not in ja.activities]
    return JobComparison(
        goodput=GoodputPair(a=ja.goodput, b=jb.goodput, delta=jb.goodput - ja.goodput),
        wall_s=WallPair(a=ja.wall_s, b=jb.wall_s),
        activities=tuple(ActivityPair(name=k, a=ja.activities.get(k, 0.0), b=jb.activities.get(k, 0.0)) for k in names),
    )


def _mean_job(given: Sequence[Job]) -> Job | None:
    """The mean over ranks; a restarted rank counts over its run's attempts."""
    jobs: list[Job | RunView] = [j.run or j for j in given if j.wall_s]
    if not jobs:
        return None
    n = len(jobs)
    act: dict[str, float] = {}
    for j in jobs:
        for k, v in j.activities.items():
            act[k] = act.get(k, 0.0) + float(v or 0.0) / n
    return Job(
        wall_s=sum(float(j.wall_s) for j in jobs) / n,
        goodput=sum(float(j.goodput or 0.0) for j in jobs) / n,
        activities=act,
    )


def compare_lines(job: JobComparison | None) -> list[str]:
    """``goodput A 10.0% -> B 42.0% (+32.0 points)`` and seconds per activity."""
    if job is None:
        return []
    g = job.goodput
    lines = [
        f"goodput: A {100 * g.a:.1f}% -> B {100 * g.b:.1f}% ({100 * g.delta:+.1f} points); "
        f"wall time A {_s(job.wall_s.a)}, B {_s(job.wall_s.b)}"
    ]
    parts = [f"{r.name} {_s(r.a)} -> {_s(r.b)}" for r in job.activities]
    if parts:
        lines.append("  " + ", ".join(parts))
    return lines
