"""Named time between steps: the user's ``phase(name)`` with no step open.

A checkpoint between epochs, a save after the last step: ``NamedBetween`` records
the outermost such phase and the named phases inside it as one ``BetweenSteps``
(record/timeline.py), handed on when the outermost ends. The ``Tracker`` owns one.
Training thread only (``open_start`` is read from others).
"""

from __future__ import annotations

from collections.abc import Callable

from otel_training import semconv as sc
from otel_training.record.phase_stack import PhaseStack
from otel_training.record.timeline import BetweenSteps, PhaseRecord


class NamedBetween:
    """The named phases open between steps, and their record."""

    def __init__(self, phases: PhaseStack, hand_on: Callable[[BetweenSteps], None]) -> None:
        self._phases = phases  # its clock, and whether a step is open
        self._hand_on = hand_on
        self._group: BetweenSteps | None = None
        self._stack: list[PhaseRecord] = []

    def begin(self, name: str) -> PhaseRecord | None:
        """Open ``name``: its record, or None while a step is open."""
        if self._phases.step is not None:
            return None
        group = self._group
        if group is None:
            group = self._group = BetweenSteps()
        start = group.time(self._phases.clock())
        stack = self._stack
        outer = stack[-1] if stack else None
        rec = PhaseRecord(name, outer.name if outer is not None else sc.MODE_BETWEEN, start, False, outer)
        group.add_phase(rec)
        stack.append(rec)
        return rec

    def end(self, rec: PhaseRecord, error: BaseException | None = None) -> None:
        """End ``rec`` (and what is still open inside it); the outermost hands the
        named time on, in time order with the steps."""
        stack = self._stack
        group = self._group
        if group is None or rec not in stack:
            return
        end = group.time(self._phases.clock())
        while stack:
            top = stack.pop()
            top.end = end
            if top is rec:
                break
        if error is not None and not isinstance(error, (StopIteration, GeneratorExit)):
            group.fail(error)
        if not stack:
            self._group = None
            self._hand_on(group)

    def end_all(self) -> None:
        """The run ends: what is still open ends now."""
        if self._stack:
            self.end(self._stack[0])

    def drop(self) -> None:
        """Forget what is open (a forked child records nothing)."""
        self._group = None
        self._stack = []

    def open_start(self) -> int | None:
        """Host ns at which the innermost open named phase began; None if none."""
        try:
            group, stack = self._group, self._stack
            if group is not None and stack:
                return group.times[stack[-1].start]
        except (AttributeError, IndexError, TypeError):
            pass
        return None
