"""The run model's sections from outside the steps' totals: the job's wall time and
goodput (with a restarted run's attempts), memory, what the run does (its facts),
and the run over time. Keys and units: docs/summary-file.md."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from otel_training.aggregate.run_codec import from_dict, keyed, nullable, to_dict

S = TypeVar("S", bound="_Section")


class _Section:
    """A section's JSON dict (``to_dict``) and the section from one (``from_dict``)."""

    __slots__ = ()

    def to_dict(self) -> dict:
        return to_dict(self)

    @classmethod
    def from_dict(cls: type[S], data: object, path: str = "") -> S:
        return from_dict(cls, data, path or cls.__name__)


# -- job: the process's wall time by activity -------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointCall(_Section):
    name: str
    count: int
    total_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint(_Section):
    saves: int = 0
    save_s: float = 0.0
    loads: int = 0
    load_s: float = 0.0
    calls: tuple[CheckpointCall, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Recompiled(_Section):
    mode: str
    step: int
    count: int
    s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Compile(_Section):
    compilations: int = 0
    recompilations: int = 0
    recompiled_at: tuple[Recompiled, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt(_Section):
    """This attempt of a restarted run."""

    number: int
    restart_s: float = 0.0
    lost_progress_s: float = 0.0
    lost_steps: int = 0
    resumed_at_step: int | None = nullable()
    previous_last_step: int | None = nullable()
    previous_exit: str | None = nullable()


@dataclass(frozen=True, slots=True, kw_only=True)
class RunView(_Section):
    """A restarted run over its attempts (this one the last)."""

    attempts: int
    wall_s: float = 0.0
    goodput: float = 0.0
    activities: Mapping[str, float] = field(default_factory=dict)
    restart_s: float = 0.0
    lost_progress_s: float = 0.0
    lost_steps: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Job(_Section):
    """The process's wall time, every second in one activity, and goodput."""

    wall_s: float
    goodput: float
    activities: Mapping[str, float] = field(default_factory=dict)
    named: tuple[str, ...] = ()
    start: str | None = None
    ideal_step_s: float | None = nullable()
    slow_step_badput_s: float | None = None
    slow_steps: int | None = None
    checkpoint: Checkpoint | None = None
    compile: Compile | None = None
    attempt: Attempt | None = None
    run: RunView | None = None


# -- memory -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Creep(_Section):
    """Memory that grows steadily with the steps (a leak)."""

    mb_per_100_steps: float
    growth_bytes: int
    from_step: int
    to_step: int
    r2: float
    points: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Memory(_Section):
    kind: str | None = nullable()
    device: str | None = nullable()
    first_bytes: int | None = nullable()
    last_bytes: int | None = nullable()
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    creep: Creep | None = nullable()


# -- what the run does --------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerFacts(_Section):
    class_name: str | None = keyed("class", default=None, metadata={"nullable": True})
    fused: bool | None = nullable()
    foreach: bool | None = nullable()


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderFacts(_Section):
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = nullable()
    batch_size: int | None = nullable()
    shuffle: bool | None = nullable()


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFacts(_Section):
    """What the run already does, for advice that fits it."""

    device: str | None = nullable()
    cpus: int | None = nullable()
    autocast_dtype: str | None = nullable()
    autocast_device: str | None = nullable()
    compiled: bool = False
    optimizers: tuple[OptimizerFacts, ...] = ()
    loaders: tuple[LoaderFacts, ...] = ()


# -- the run over time --------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Series(_Section):
    """One mode's windows of consecutive steps: columns, one value per window."""

    width: int
    t: tuple[float, ...] = ()
    wall_s: tuple[float, ...] = ()
    first_step: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    step_s: tuple[float, ...] = ()
    p50_s: tuple[float, ...] = ()
    p90_s: tuple[float, ...] = ()
    max_s: tuple[float, ...] = ()
    samples: tuple[int, ...] = ()
    phases: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    gpu_idle_s: tuple[float, ...] | None = None
    wait_s: tuple[float, ...] | None = None


# -- profiles: a few steps' operators, recorded when a trigger fired ----------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileOp(_Section):
    """An operator (a kernel on CUDA) of a profile, in the phase it ran in (launched in, on CUDA)."""

    phase: str
    name: str
    s: float
    share: float = 0.0  # of every operator's time in the profile
    phase_share: float = 0.0  # of the operators' time in this phase


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileStep(_Section):
    """A step the profile recorded."""

    mode: str
    step: int
    own_s: float  # its time less exposed communication
    ratio: float | None = nullable()  # own time over the train steps' rolling median then
    slow: bool = False  # over the periodic trigger's factor of the median
    covered: float = 1.0  # its share inside the profiler's recording


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile(_Section):
    """One profile: why it was taken, what it recorded, its top operators."""

    trigger: str
    file: str | None = nullable()
    steps: tuple[ProfileStep, ...] = ()
    trigger_step: int | None = nullable()
    trigger_own_s: float | None = nullable()
    median_s: float | None = nullable()
    ratio: float | None = nullable()
    period: int | None = None
    captured_slow: bool | None = nullable()
    device: str | None = nullable()
    compiled: bool = False
    note: str | None = None
    recording_s: float = 0.0
    events: int = 0
    top: tuple[ProfileOp, ...] = ()
    phases: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Profiles(_Section):
    """The profile triggers on, how close the run came to them, and the profiles taken."""

    triggers: tuple[str, ...] = ()
    max_ratio: float | None = nullable()  # the slowest train step's own time over the median, after warm-up
    requested: int = 0
    profiles: tuple[Profile, ...] = ()
    off: str | None = None  # why profiling stopped for the rest of the run
