"""Named time between steps, resolved once for the consumers (pipeline thread).

The training thread hands on a ``BetweenSteps`` (record/timeline.py) when the
user's outermost ``phase(name)`` opened with no step open ends: a checkpoint
between epochs, a save after the last step. It becomes one immutable
``BetweenRecord``; coverage counts it as accounted-for time and lists it by name,
the spans and the trace file show it (under no step), the metrics record its
``training.phase.duration`` points with ``training.mode="between_steps"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from otel_training.record.timeline import BetweenSteps

if TYPE_CHECKING:
    from otel_training.aggregate.sampling import TailCapture


class NamedPhase(NamedTuple):
    name: str
    parent: str  # the enclosing named phase, or "between_steps" at the top
    up: int  # index of the enclosing phase in ``BetweenRecord.phases``; -1 at the top
    start: int  # host ns (perf_counter_ns)
    end: int


class BetweenRecord(NamedTuple):
    phases: tuple[NamedPhase, ...]  # the outermost first
    error: BaseException | None
    traced: bool  # a span and trace-file events are made of it

    @property
    def start(self) -> int:
        return self.phases[0].start

    @property
    def end(self) -> int:
        return self.phases[0].end

    @property
    def name(self) -> str:
        return self.phases[0].name


def resolve_between(group: BetweenSteps, capture: TailCapture | None = None) -> BetweenRecord | None:
    """The record of ``group`` (None if it holds no ended phase); ``capture``: the
    tail capture whose token bucket bounds the spans made per second."""
    times = group.times
    index = {id(rec): i for i, rec in enumerate(group.phases)}
    phases = []
    for rec in group.phases:
        if rec.end < 0 or rec.end >= len(times):
            continue
        up = index.get(id(rec.outer), -1) if rec.outer is not None else -1
        phases.append(NamedPhase(rec.name, rec.parent_name, up, times[rec.start], times[rec.end]))
    if not phases or group.phases[0].end < 0:
        return None
    end = phases[0].end
    traced = capture is None or capture.take(end)
    return BetweenRecord(tuple(phases), group.error, traced)
