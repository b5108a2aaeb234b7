"""The run model: the run summary as typed, frozen sections.

What the run-end table, the summary file (``OTEL_TRAINING_SUMMARY_FILE``), ``report``,
``compare`` and the HTML page read. Each producer returns its own section (the steps'
totals per mode: ``aggregate/summary.py``; coverage and the self-check:
``aggregate/coverage.py``; the job: ``aggregate/job.py``; memory:
``aggregate/memory.py``; the run over time: ``aggregate/timeseries.py``) and the
runtime builds one :class:`Run`. ``Run.to_json`` is the file; ``Run.from_json`` reads
it and every earlier version of it, refusing a wrong-typed key by name
(:class:`SummaryError`). The file format: docs/summary-file.md and the JSON Schema
``summary.schema.json`` next to this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from otel_training import semconv as sc
from otel_training.aggregate.run_codec import SummaryError, from_dict, nullable
from otel_training.aggregate.run_codec import json_schema as codec_schema
from otel_training.aggregate.run_sections import (
    Attempt,
    Checkpoint,
    CheckpointCall,
    Compile,
    Creep,
    Job,
    LoaderFacts,
    Memory,
    OptimizerFacts,
    Profile,
    ProfileOp,
    Profiles,
    ProfileStep,
    Recompiled,
    RunFacts,
    RunView,
    Series,
    _Section,
)

SCHEMA = "otel-training/summary/v1"

__all__ = [
    "SCHEMA",
    "SummaryError",
    "Run",
    "Mode",
    "Phase",
    "Flops",
    "Telemetry",
    "Coverage",
    "NamedTime",
    "CheckFinding",
    "Job",
    "Checkpoint",
    "CheckpointCall",
    "Compile",
    "Recompiled",
    "Attempt",
    "RunView",
    "Memory",
    "Creep",
    "RunFacts",
    "OptimizerFacts",
    "LoaderFacts",
    "Series",
    "Profiles",
    "Profile",
    "ProfileOp",
    "ProfileStep",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase(_Section):
    """One phase (by name and parent) of a mode's steps."""

    name: str
    parent: str = sc.SPAN_STEP
    total_s: float
    mean_s: float = 0.0
    count: int = 0
    share: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Flops(_Section):
    """FLOPs per step, achieved FLOP/s and MFU of a mode."""

    per_step: float
    total: float = 0.0
    flop_s: float = 0.0
    peak_flop_s: float | None = nullable()
    mfu: float | None = nullable()
    dtype: str | None = nullable()
    device: str | None = nullable()
    source: str | None = nullable()
    count_cost_s: float | None = nullable()
    counted_step: int | None = None
    counted_step_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Mode(_Section):
    """The steps of one mode (``train``, ``eval``): totals, statistics, phases."""

    steps: int
    timed_steps: int | None = None  # (None: a file from before the FLOP-count step was left out)
    samples: int = 0
    tokens: int | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    flops: Flops | None = None
    step_time_s: float
    microbatches: int | None = None
    skipped_updates: int | None = None
    wall_s: float = 0.0
    step_mean_s: float = 0.0
    step_p50_s: float | None = None
    step_p90_s: float | None = None
    step_max_s: float | None = None
    phases: tuple[Phase, ...] = ()
    gpu_idle_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Telemetry(_Section):
    """What the instrumentation dropped or failed at."""

    spans_dropped: int = 0
    steps_dropped: int = 0
    export_failures: int = 0
    errors: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class NamedTime(_Section):
    """Named time between steps (``phase(name)`` with no step open)."""

    name: str
    count: int
    total_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Coverage(_Section):
    """How much of the training loop's wall time lies inside steps."""

    loop_s: float = 0.0
    in_steps_s: float = 0.0
    share: float = 0.0
    named_s: float | None = None
    accounted_share: float | None = None
    named: tuple[NamedTime, ...] | None = None
    outside_s: float = 0.0
    gaps: int = 0
    largest_gap_s: float = 0.0
    largest_gap_after_step: int | None = nullable()
    before_first_step_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckFinding(_Section):
    """A self-check finding: step detection is in doubt."""

    kind: str
    cause: str = ""
    fix: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Run(_Section):
    """One process's run: the summary file."""

    schema: str = SCHEMA
    service: str | None = nullable()
    run_id: str | None = nullable()
    host: str | None = nullable()
    rank: int | None = nullable()
    world_size: int | None = nullable()
    pid: int | None = nullable()
    timing: str | None = nullable()
    started_at: float | None = nullable()
    ended_at: float | None = nullable()
    modes: Mapping[str, Mode]
    telemetry: Telemetry = Telemetry()
    step_boundary: str | None = None
    loaders: tuple[str, ...] | None = None
    coverage: Coverage | None = None
    self_check: tuple[CheckFinding, ...] | None = None
    memory: Memory | None = None
    run: RunFacts | None = None
    job: Job | None = None
    timeseries: Mapping[str, Series] | None = None
    profiles: Profiles | None = None

    def to_json(self) -> str:
        """The summary file's text."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> Run:
        """A summary file's text (this version's or an earlier one's). Raises
        ``json.JSONDecodeError`` for text that is no JSON and :class:`SummaryError`
        for a file that is no run summary, or a key missing or of the wrong type."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: object, path: str = "") -> Run:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise SummaryError("schema", f"is not {SCHEMA!r}: no otel-training run summary")
        return from_dict(cls, data, path)

    def mode(self, name: str) -> Mode | None:
        return self.modes.get(name)


SCHEMA_FILE = "summary.schema.json"  # next to this module, shipped in the package


def json_schema() -> dict:
    """The summary file's JSON Schema, as shipped in ``SCHEMA_FILE`` (written with
    ``json.dumps(json_schema(), indent=2) + "\n"``)."""
    return codec_schema(
        Run,
        {"schema": SCHEMA},
        **{
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "otel-training run summary (OTEL_TRAINING_SUMMARY_FILE), version 1",
            "$comment": "keys and units: docs/summary-file.md; readers ignore keys they do not know",
        },
    )
