"""A report, typed: one run's summary files (one per rank) or its Prometheus series,
merged over ranks, in the run model's vocabulary (``samples_per_s``, ...).

``report/sources.py`` and ``report/prometheus.py`` build a :class:`Report`;
``report/build.py`` adds the mode it is diagnosed for and its findings; the text, the
charts, the HTML page and ``compare`` read it. :meth:`Report.to_dict` is what
``otel-training report --json`` prints (docs/report.md): the keys it always had,
``throughput_sps`` among them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_training import semconv as sc
from otel_training.aggregate.run_codec import keyed, nullable
from otel_training.aggregate.run_model import (
    CheckFinding,
    Coverage,
    Flops,
    Job,
    Memory,
    Mode,
    Phase,
    RunFacts,
    Telemetry,
)
from otel_training.aggregate.run_sections import _Section
from otel_training.diagnosis.evidence import RankJob, RankMemory, RankSeries, RankTimes
from otel_training.diagnosis.finding import Finding

SOURCE_SUMMARY, SOURCE_PROMETHEUS = "summary", "prometheus"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportMode(_Section):
    """A mode over every rank: counts and seconds summed, rates summed over ranks,
    each phase's total with its share of the summed step time."""

    steps: int = 0
    samples: int = 0
    step_time_s: float = 0.0
    wall_s: float = 0.0  # the longest rank's
    samples_per_s: float = keyed("throughput_sps", default=0.0)
    tokens: int = 0
    tokens_per_s: float = 0.0
    gpu_idle_s: Mapping[str, float] = field(default_factory=dict)
    step_max_s: float | None = None
    step_p50_s: float | None = None  # (one rank: its own; several: not known)
    step_p90_s: float | None = None
    step_mean_s: float = 0.0
    phases: tuple[Phase, ...] = ()
    gpu_idle_share: float | None = nullable()
    flops: Flops | None = None  # FLOP/s and peaks summed over ranks, MFU their mean

    def as_mode(self) -> Mode:
        """The mode as a run summary's, for diagnosis."""
        return Mode(
            steps=self.steps,
            samples=self.samples,
            tokens=self.tokens,
            samples_per_s=self.samples_per_s,
            tokens_per_s=self.tokens_per_s,
            flops=self.flops,
            step_time_s=self.step_time_s,
            wall_s=self.wall_s,
            step_mean_s=self.step_mean_s,
            step_p50_s=self.step_p50_s,
            step_p90_s=self.step_p90_s,
            step_max_s=self.step_max_s,
            phases=self.phases,
            gpu_idle_s=self.gpu_idle_s,
        )

    def top_phases(self) -> list[Phase]:
        """The top-level phases (children of the step), the largest share first."""
        return sorted((p for p in self.phases if p.parent == sc.SPAN_STEP), key=lambda p: -p.share)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankRow(_Section):
    """One rank's own numbers for a mode: its step time and rates, its top-level
    phases' shares and seconds per step, its waits and own work by part."""

    steps: int = 0
    samples: int = 0
    step_time_s: float = 0.0
    step_mean_s: float = 0.0
    phases: Mapping[str, float] = field(default_factory=dict)  # top-level phase -> share of the step
    phase_mean_s: Mapping[str, float] = field(default_factory=dict)
    samples_per_s: float = keyed("throughput_sps", default=0.0)
    tokens: int = 0
    tokens_per_s: float = 0.0
    flops: Flops | None = None
    wait_mean_s: float | None = None
    part_mean_s: Mapping[str, float] | None = None
    rank: int | None = nullable()
    host: str | None = nullable()
    pid: int | None = None
    file: str | None = None
    instance: str | None = None  # (Prometheus: the scrape target)
    step_p50_s: float | None = None
    step_p90_s: float | None = None
    step_max_s: float | None = None

    def times(self) -> RankTimes:
        """What the verdict reads of the row."""
        return RankTimes(
            rank=self.rank,
            host=self.host,
            step_mean_s=self.step_mean_s,
            phases=self.phases,
            phase_mean_s=self.phase_mean_s,
            wait_mean_s=self.wait_mean_s,
            part_mean_s=self.part_mean_s,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu(_Section):
    """One GPU's utilization over the range (``hw_gpu_utilization_ratio``)."""

    host: str = ""
    gpu: str = ""
    index: str = ""
    model: str = ""
    mean: float = 0.0
    min: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuUtilization(_Section):
    """Every GPU of the run together: the mean of their means, the lowest minimum."""

    mean: float
    min: float


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuLine(_Section):
    """One GPU's gauge over time (the HTML page's GPU charts)."""

    host: str = ""
    gpu: str = ""
    t: tuple[float, ...] = ()
    v: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeRange(_Section):
    start: float = 0.0
    end: float = 0.0


@dataclass(frozen=True, slots=True)
class Who:
    """The process a rank's section came from."""

    rank: int | None = None
    host: str | None = None
    instance: str | None = None  # (Prometheus: the scrape target)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "host": self.host}
        if self.instance is not None:
            out["instance"] = self.instance
        return out


@dataclass(frozen=True, slots=True)
class Ranked:
    """A rank's section (coverage, a self-check finding, memory, job), the JSON flat:
    the rank's ``rank`` and ``host`` beside the section's own keys."""

    who: Who
    section: Any  # Coverage | CheckFinding | Memory | Job

    def to_dict(self) -> dict[str, Any]:
        return {**self.who.to_dict(), **self.section.to_dict()}


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """A run's report (``otel-training report``, ``compare``, the HTML page)."""

    source: str  # SOURCE_SUMMARY or SOURCE_PROMETHEUS
    prometheus: str | None = None  # the server's URL
    selector: str | None = None  # the run's label matchers, ``{...}``
    files: tuple[str, ...] = ()
    earlier_attempts: tuple[str, ...] = ()  # a restarted rank's earlier summaries (its last one's job.run covers them)
    service: str | None = None
    run: str | None = None
    timing: str | None = None
    world_size: int | None = None
    range: TimeRange = TimeRange()
    modes: Mapping[str, ReportMode] = field(default_factory=dict)
    ranks: Mapping[str, tuple[RankRow, ...]] = field(default_factory=dict)  # per mode, one row per rank
    gpus: tuple[Gpu, ...] = ()
    gpu_utilization: GpuUtilization | None = None
    telemetry: Telemetry = Telemetry()
    coverage: tuple[Ranked, ...] = ()  # of Coverage
    self_check: tuple[Ranked, ...] = ()  # of CheckFinding
    memory: tuple[Ranked, ...] = ()  # of Memory
    job: tuple[Ranked, ...] = ()  # of Job: per rank, the wall time by activity
    profiles: tuple[Ranked, ...] = ()  # of Profile: each profile a rank recorded (docs/profiles.md)
    timeseries: tuple[RankSeries, ...] | None = None  # per rank, the run over time
    gpu_series: Mapping[str, tuple[GpuLine, ...]] | None = None  # "utilization", "memory"
    run_facts: RunFacts | None = None  # what the run already does (the lowest rank's), for advice
    loaders: tuple[str, ...] | None = None
    mode: str | None = None  # the mode diagnosed (report/build.py)
    findings: tuple[Finding, ...] | None = None

    # -- typed views, for what reads the report --------------------------------------------
    def modes_with_steps(self) -> list[str]:
        """Modes with steps, train first."""
        return sorted((m for m, v in self.modes.items() if v.steps), key=lambda m: (m != sc.MODE_TRAIN, m))

    def rank_rows(self, mode: str | None) -> tuple[RankRow, ...]:
        return self.ranks.get(mode, ()) if mode else ()

    def coverages(self) -> list[tuple[int | None, Coverage]]:
        return [(c.who.rank, c.section) for c in self.coverage]

    def checks(self) -> list[tuple[int | None, CheckFinding]]:
        return [(c.who.rank, c.section) for c in self.self_check]

    def memories(self) -> list[RankMemory]:
        return [RankMemory(rank=m.who.rank, memory=m.section) for m in self.memory]

    def jobs(self) -> list[RankJob]:
        return [RankJob(rank=j.who.rank, host=j.who.host, job=j.section) for j in self.job]

    def profile_list(self) -> list[tuple[int | None, Any]]:
        """(rank, Profile) of every profile the ranks recorded."""
        return [(p.who.rank, p.section) for p in self.profiles]

    def first_finding(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    # -- the JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """``otel-training report --json``."""
        prom = self.source == SOURCE_PROMETHEUS
        out: dict[str, Any] = {"source": self.source}
        if prom:
            out.update(prometheus=self.prometheus, selector=self.selector)
        else:
            out.update(
                files=list(self.files),
                earlier_attempts=list(self.earlier_attempts),
                service=self.service,
            )
        out["run"] = self.run
        if not prom:
            out.update(timing=self.timing, world_size=self.world_size)
        out.update(
            range=self.range.to_dict(),
            modes={k: m.to_dict() for k, m in self.modes.items()},
            ranks={k: [r.to_dict() for r in rows] for k, rows in self.ranks.items()},
            gpus=[g.to_dict() for g in self.gpus],
            gpu_utilization=None if self.gpu_utilization is None else self.gpu_utilization.to_dict(),
            telemetry=self.telemetry.to_dict(),
        )
        if not prom:
            out.update(coverage=[c.to_dict() for c in self.coverage], self_check=[c.to_dict() for c in self.self_check])
        out.update(memory=[m.to_dict() for m in self.memory], job=[j.to_dict() for j in self.job])
        if self.profiles:  # (absent where none was recorded: the keys reports always had)
            out["profiles"] = [p.to_dict() for p in self.profiles]
        if self.timeseries is not None:
            out["timeseries"] = [series_dict(r) for r in self.timeseries]
        if self.gpu_series is not None:
            out["gpu_series"] = {k: [g.to_dict() for g in v] for k, v in self.gpu_series.items()}
        if not prom:
            out.update(
                run_facts=None if self.run_facts is None else self.run_facts.to_dict(),
                loaders=list(self.loaders or ()),
            )
        if self.mode is not None or self.findings is not None:
            out.update(mode=self.mode, findings=[f.to_dict() for f in self.findings or ()])
        return out


def series_dict(r: RankSeries) -> dict[str, Any]:
    """A rank's run over time as the report's JSON."""
    return {"rank": r.rank, "host": r.host, "modes": {k: v.to_dict() for k, v in r.modes.items()}}


__all__ = [
    "SOURCE_PROMETHEUS",
    "SOURCE_SUMMARY",
    "Gpu",
    "GpuLine",
    "GpuUtilization",
    "Memory",
    "Job",
    "RankRow",
    "Ranked",
    "Report",
    "ReportMode",
    "TimeRange",
    "Who",
    "series_dict",
]
