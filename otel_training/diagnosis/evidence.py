"""What :func:`~otel_training.diagnosis.verdict.diagnose` reads, typed: one run's
summary (:meth:`Evidence.of_run`), or a report's ranks merged, in the summary's
vocabulary (report/build.py builds it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from otel_training.aggregate.run_model import Job, Memory, Mode, Run, RunFacts, Series, Telemetry
from otel_training.aggregate.run_sections import _Section


@dataclass(frozen=True, slots=True, kw_only=True)
class RankTimes(_Section):
    """One rank's own numbers for a mode: its mean step, its top-level phases' shares
    and, where known, seconds per step (``phase_mean_s``), its waits
    (``wait_mean_s``) and its own work by part (``part_mean_s``)."""

    rank: int | None = None
    host: str | None = None
    step_mean_s: float | None = None
    phases: Mapping[str, float] = field(default_factory=dict)
    phase_mean_s: Mapping[str, float] = field(default_factory=dict)
    wait_mean_s: float | None = None
    part_mean_s: Mapping[str, float] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSeries:
    """One rank's run over time, by mode."""

    rank: int | None
    host: str | None
    modes: Mapping[str, Series]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    """One rank's memory section (``rank`` None: a single run's)."""

    rank: int | None
    memory: Memory


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """The modes to diagnose with what is known around them."""

    modes: Mapping[str, Mode]
    telemetry: Telemetry = Telemetry()
    facts: RunFacts | None = None  # what the run already does (the summary's ``run``)
    loaders: tuple[str, ...] = ()
    gpu_mean: float | None = None  # mean GPU utilization over the run's GPUs (0..1)
    ranks: tuple[RankTimes, ...] = ()
    memory: tuple[RankMemory, ...] = ()
    timeseries: tuple[RankSeries, ...] = ()

    @classmethod
    def of_run(cls, run: Run, ranks: tuple[RankTimes, ...] = (), gpu_mean: float | None = None) -> Evidence:
        """One process's summary (with ``ranks`` and ``gpu_mean`` measured elsewhere)."""
        return cls(
            modes=run.modes,
            telemetry=run.telemetry,
            facts=run.run,
            loaders=run.loaders or (),
            gpu_mean=gpu_mean,
            ranks=ranks,
            memory=(RankMemory(rank=None, memory=run.memory),) if run.memory is not None else (),
            timeseries=(RankSeries(rank=run.rank, host=run.host, modes=run.timeseries),)
            if run.timeseries is not None
            else (),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RankJob:
    """One rank's job section (its wall time by activity and goodput)."""

    rank: int | None = None
    host: str | None = None
    job: Job
