"""What ``otel-training top`` draws (Rich renderables): the overview (step time and its
trend, phase shares of the last seconds and of the run, throughput, memory, hardware,
goodput, the verdict so far), the rank table with the straggler marked, and a rank x
time heatmap of step time."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from otel_training import semconv as sc
from otel_training.diagnosis.formatting import ms, share_pct
from otel_training.diagnosis.verdict_ranks import own_work
from otel_training.report.model import Report, ReportMode

from .report import StepTimes
from .state import ProcessLive

VIEWS = ("overview", "ranks", "heatmap")
WINDOW_EXPORTS = 5  # "last" columns: the last five exports of each process
STALE_AFTER = 3.0  # a process silent for this many export intervals is stale
_BLOCKS = " ▁▂▃▄▅▆▇█"
_HEAT = ("grey23", "green4", "green3", "yellow3", "dark_orange", "red3")


@dataclass(frozen=True, slots=True)
class Frame:
    """One refresh's numbers (made by the command; the screen only reads)."""

    run: Report  # the run so far
    last: Report  # the last WINDOW_EXPORTS windows
    steps: StepTimes
    processes: Sequence[ProcessLive]
    heat: Sequence[tuple[ProcessLive, list[float | None]]]
    interval_s: float | None  # the jobs' export interval, as seen
    source: str  # what feeds the view: "launched: python train.py" / "listening on ..."
    job_status: str | None = None  # launch mode: "running", "ended (exit 0)"
    job_tail: tuple[str, ...] = ()  # launch mode: the job's last output lines, while it shows no steps


def _range(bucket: tuple[float, float]) -> str:
    low, high = bucket
    return f"{ms(low)}–{ms(high)}" if high != float("inf") else f"> {ms(low)}"


def sparkline(values: Sequence[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(_BLOCKS[1 + int((v - lo) / span * (len(_BLOCKS) - 2))] for v in values)


def status(proc: ProcessLive, interval: float | None, now: float | None = None) -> str:
    """``live``, ``stale N s`` or ``ended``."""
    if proc.ended:
        return "ended" if proc.exited is None else f"ended (exit {proc.exited})"
    silent = proc.silent_s(now)
    if silent > STALE_AFTER * max(interval or 1.0, 1.0):
        return f"stale {silent:.0f} s"
    return "live"


def _mode(report: Report) -> str | None:
    return report.mode or next(iter(report.modes_with_steps()), None)


def header(frame: Frame, view: str) -> Text:
    run = frame.run
    n = len(frame.processes)
    who = f"run {run.run}" if run.run else "waiting for a job's first export"
    line = Text(f"otel-training top · {who} · {n} process{'es' if n != 1 else ''} · {frame.source}", style="bold")
    if frame.job_status:
        line.append(f" · job {frame.job_status}", style="cyan")
    if frame.interval_s and frame.interval_s > 1.5:
        line.append(
            f"\n  exports arrive every {frame.interval_s:.0f} s: set OTEL_METRIC_EXPORT_INTERVAL=1000 "
            "in the job for a view refreshed each second",
            style="yellow",
        )
    keys = "  ".join(f"[{i + 1}] {v}" + (" *" if v == view else "") for i, v in enumerate(VIEWS))
    line.append(f"\n  {keys}   [q] quit", style="dim")
    return line


def _phases(mode: str, run: ReportMode, last: ReportMode | None) -> Table:
    t = Table(title=f"{mode} phases (share of step time)", expand=False, title_justify="left")
    t.add_column("phase")
    t.add_column(f"last {WINDOW_EXPORTS} exports", justify="right")
    t.add_column("run", justify="right")
    t.add_column("ms/step (run)", justify="right")
    lasts = {p.name: p for p in last.top_phases()} if last is not None else {}
    for p in run.top_phases():
        recent = lasts.get(p.name)
        t.add_row(p.name, share_pct(recent.share) if recent else "-", share_pct(p.share), ms(p.mean_s))
    return t


def overview(frame: Frame) -> RenderableType:
    run, last = frame.run, frame.last
    mode = _mode(run)
    if mode is None:  # (the hardware of a process that times no steps: an agent, a launcher)
        return Group(
            Text("no steps yet: the view fills at the job's first export after its first step"), _machine(frame)
        )
    m, lm = run.modes[mode], last.modes.get(mode)
    st = frame.steps
    head = Text()
    head.append(f"{mode}: {m.steps:,} steps", style="bold")
    head.append(f"   step mean {ms(st.last_mean_s)} ms (last {WINDOW_EXPORTS} exports), {ms(st.mean_s)} ms (run)")
    quantiles = [f"{name} in {_range(b)} ms" for name, b in (("p50", st.p50_in), ("p90", st.p90_in)) if b]
    if quantiles:
        head.append(f"\n  {', '.join(quantiles)} (the step-duration histogram's buckets)")
    if st.trend_s:
        head.append(f"\n  trend  {sparkline(st.trend_s)}  ({ms(min(st.trend_s))}..{ms(max(st.trend_s))} ms a step)")
    rates = f"\n  {lm.samples_per_s if lm else m.samples_per_s:,.1f} samples/s (last), {m.samples_per_s:,.1f} (run)"
    if m.tokens_per_s:
        rates += f", {m.tokens_per_s:,.0f} tokens/s"
    if m.flops is not None and m.flops.mfu is not None:
        rates += f", MFU {share_pct(m.flops.mfu)}"
    head.append(rates)
    parts: list[RenderableType] = [head, _phases(mode, m, lm), _machine(frame)]
    finding = run.first_finding()
    if finding is not None:
        verdict = Text()
        verdict.append(f"verdict so far: {finding.title}", style="bold magenta")
        verdict.append(f"\n  {finding.detail}")
        for a in finding.advice[:2]:
            verdict.append(f"\n  - {a}", style="dim")
        parts.append(verdict)
    return Group(*parts)


def _machine(frame: Frame) -> Text:
    out = Text()
    run = frame.run
    for mem in run.memories():
        who = f"rank {mem.rank} " if len(run.memory) > 1 and mem.rank is not None else ""
        kind = "RSS" if mem.memory.kind == "cpu" else "allocated"
        out.append(f"memory: {who}{kind} {(mem.memory.last_bytes or 0) / 2**30:.2f} GiB\n")
    for g in run.gpus:
        out.append(f"GPU {g.index or g.gpu} ({g.model}) on {g.host}: {share_pct(g.mean)} busy\n")
    hosts: set[str] = set()
    for proc in frame.processes:  # one process a host samples it
        cpu = proc.gauges.get("system.cpu.utilization")
        if cpu is None or proc.host in hosts:
            continue
        hosts.add(proc.host)
        avail = proc.gauges.get("system.linux.memory.available")
        out.append(f"host {proc.host}: CPU {share_pct(cpu)}")
        if avail is not None:
            out.append(f", {avail / 2**30:.1f} GiB memory available")
        out.append("\n")
    jobs = run.jobs()
    if jobs:
        mean = sum(j.job.goodput for j in jobs) / len(jobs)
        out.append(f"goodput so far: {share_pct(mean)} of the wall time in train steps")
    return out


def ranks(frame: Frame) -> RenderableType:
    run = frame.run
    mode = _mode(run)
    rows = run.rank_rows(mode)
    if not rows:
        return Text("no steps yet")
    finding = run.first_finding()
    straggler = finding.rank if finding is not None and finding.kind == "straggler" else None
    by_key = {p.key: p for p in frame.processes}
    t = Table(title=f"ranks ({mode}, ms a step over the run)", title_justify="left")
    for col in ("rank", "host", "steps", "step", "data wait", "communication", "own work", "status"):
        t.add_column(col, justify="left" if col in ("host", "status") else "right")
    for r in rows:
        phase = r.phase_mean_s
        comm = (r.wait_mean_s or 0.0) if r.wait_mean_s is not None else phase.get(sc.PHASE_REDUCE_METRICS, 0.0)
        proc = by_key.get(r.instance or "")
        mark = " ◀ straggler" if straggler is not None and r.rank == straggler else ""
        t.add_row(
            f"{r.rank if r.rank is not None else '?'}{mark}",
            r.host or "",
            f"{r.steps:,}",
            ms(r.step_mean_s),
            ms(phase.get(sc.PHASE_DATALOADER_NEXT, 0.0)),
            ms(comm),
            ms(own_work(r.times())),
            status(proc, frame.interval_s) if proc is not None else "",
            style="bold red" if mark else None,
        )
    return Group(t, Text(f"verdict so far: {finding.title}: {finding.detail}" if finding else ""))


def heatmap(frame: Frame) -> RenderableType:
    mode = _mode(frame.run)
    values = [v for _, row in frame.heat for v in row if v is not None]
    if not values:
        return Text("no steps yet")
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    out = Text(f"step time per rank, one column an export ({mode}; {ms(lo)}..{ms(hi)} ms)\n")
    for proc, row in frame.heat:
        out.append(f"rank {proc.rank if proc.rank is not None else '-':>3} ")
        for v in row:
            if v is None:
                out.append(" ")
            else:
                out.append("█", style=_HEAT[min(len(_HEAT) - 1, int((v - lo) / span * len(_HEAT)))])
        out.append(f"  {status(proc, frame.interval_s)}\n")
    return out


def screen(frame: Frame, view: str) -> RenderableType:
    body = {"overview": overview, "ranks": ranks, "heatmap": heatmap}[view](frame)
    if frame.job_tail:
        body = Group(body, Text("\nthe job's output (last lines):", style="bold"), Text("\n".join(frame.job_tail)))
    when = time.strftime("%H:%M:%S")
    return Panel(Group(header(frame, view), Text(""), body), title=f"otel-training top {when}", title_align="right")
