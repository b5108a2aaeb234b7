"""Two runs compared, typed: what :func:`~otel_training.report.compare.compare` finds
(each number of A and B, its change judged against the noise), what ``compare``'s
text, the HTML page and the CI gate read; :meth:`Comparison.to_dict` is
``otel-training compare --json``."""

from __future__ import annotations

from dataclasses import dataclass

from otel_training.aggregate.run_codec import keyed, nullable
from otel_training.aggregate.run_sections import _Section
from otel_training.diagnosis.finding import Finding
from otel_training.diagnosis.goodput_text import JobComparison
from otel_training.report.model import TimeRange

IMPROVEMENT, REGRESSION, INCONCLUSIVE = "improvement", "regression", "inconclusive"


@dataclass(frozen=True, slots=True, kw_only=True)
class Judged(_Section):
    """A number of A and B (lower is better), its change and whether it counts: it
    counts (``improvement``, ``regression``) beyond ``threshold``."""

    a: float
    b: float
    delta: float
    delta_rel: float | None = nullable()
    noise: float | None = nullable()  # the two runs' combined standard error (None: runs too short)
    threshold: float
    change: str  # IMPROVEMENT, REGRESSION or INCONCLUSIVE


@dataclass(frozen=True, slots=True, kw_only=True)
class StepJudged(Judged):
    """Time per step, or per sample when the batch size changed."""

    per: str  # "step" or "sample"


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseJudged(Judged):
    """A top-level phase's seconds per step, with its share of the step in each run."""

    name: str
    share_a: float
    share_b: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Throughput(_Section):
    a: float
    b: float
    delta: float
    delta_rel: float | None = nullable()


@dataclass(frozen=True, slots=True, kw_only=True)
class Side(_Section):
    """Which run a side is, and where it was read from."""

    run: str | None = nullable()
    source: str
    where: tuple[str, ...] | str | None = keyed("from", default=None, metadata={"nullable": True})
    range: TimeRange

    def where_text(self) -> str:
        return ", ".join(self.where) if isinstance(self.where, tuple) else str(self.where)


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdicts(_Section):
    """Each run's first finding."""

    a: Finding | None = nullable()
    b: Finding | None = nullable()


@dataclass(frozen=True, slots=True, kw_only=True)
class Gate(_Section):
    """``--fail-on-regression PCT``: B's step time against A's."""

    max_regression_pct: float
    delta_rel: float | None = nullable()
    noise_rel: float | None = nullable()
    beyond_noise: bool
    failed: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison(_Section):
    job: JobComparison | None = nullable()  # goodput A vs B
    mode: str
    a: Side
    b: Side
    result: str  # the step time's change
    changed_phase: str | None = nullable()  # the phase that moved most the way the step did
    step: StepJudged
    throughput: Throughput
    phases: tuple[PhaseJudged, ...] = ()
    verdict: Verdicts
    noise_model: str
    gate: Gate | None = None

    def changed(self) -> PhaseJudged | None:
        """The phase that moved most the way the step did (None: none, or no change)."""
        return next((p for p in self.phases if p.name == self.changed_phase), None) if self.changed_phase else None
