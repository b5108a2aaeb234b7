"""The open step's marks and phase stack: how the tracker writes a timeline.

``PhaseStack`` owns the step being recorded (``step``), the stack of open phases and
the open train/eval container; ``Tracker`` (tracker.py) adds the step lifecycle and
the hook entry points on top. Training thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from otel_training import semconv as sc
from otel_training.record.timeline import PhaseRecord, StepTimeline
from otel_training.timing.device import DeviceTimer

BATCH = "batch"  # internal name of the train_batch/eval_batch container
_STEP = sc.SPAN_STEP
CHILDREN = frozenset(sc.BATCH_CHILDREN)  # phases that open inside the container


class PhaseStack:
    """Marks and phase records of the step being recorded."""

    def __init__(self, timer: Any, clock=time.perf_counter_ns) -> None:
        self._timer = timer
        # Bound once: called at every boundary. A timer that does not override
        # mark() (host clocks only) always returns None: no tokens are kept at all.
        # One that is inert for now (``auto`` before the program initializes CUDA, as
        # in a CPU loop on a GPU machine) is asked when a step begins instead of at
        # every boundary: ``waiting_timer``.
        host_only = type(timer).mark is DeviceTimer.mark
        self.waiting_timer: Any = None if host_only or timer.observes_device else timer
        self._timer_mark = None if host_only or self.waiting_timer is not None else timer.mark
        if self._timer_mark is None:
            self._mark = self._mark_host  # type: ignore[method-assign]
        self._clock = clock
        self.step: StepTimeline | None = None
        self._stack: list[PhaseRecord] = []
        self._batch: PhaseRecord | None = None  # open container, if any
        self._batch_end = -1  # mark of the container's last child end
        self._to_device_from = -1  # mark where a pending to_device window began
        self._closures = 0  # optimizer-step closures running now

    def record_error(self, exc: BaseException) -> None:
        """The open step raised ``exc`` (the first error wins; the end of an iterator
        is no error)."""
        step = self.step
        if step is not None and step.error is None and not isinstance(exc, (StopIteration, GeneratorExit)):
            step.error = exc

    def start_device_timing(self) -> None:
        """Called when a step begins, before its first mark, while ``waiting_timer`` is
        set: once the timer starts (CUDA initialized by the program), the step's
        boundaries carry tokens (the first one, stamped before, none). A step already
        under way keeps host marks alone, so tokens stay aligned with marks."""
        timer = self.waiting_timer
        try:
            started = timer.activate()
        except Exception:  # our bug: stay on host clocks rather than break the loop
            started, self.waiting_timer = False, None
        if started:
            self.waiting_timer = None
            self._timer_mark = timer.mark
            self.__dict__.pop("_mark", None)  # back to the class's token-keeping _mark

    def _mark_host(self) -> int:
        """``_mark`` for a timer that keeps no tokens."""
        marks = self.step.marks
        marks.append(self._clock())
        return len(marks) - 1

    def _mark(self) -> int:
        """Record a boundary in the current step: its index in ``marks``."""
        step = self.step
        timer_mark = self._timer_mark
        if timer_mark is not None:
            step.tokens.append(timer_mark())
        marks = step.marks
        marks.append(self._clock())
        return len(marks) - 1

    def open_phase_start(self) -> int | None:
        """Host ns at which the innermost phase still open began (the train/eval
        container excluded: it stays open between an update and the next piece); None
        outside phases. Read from other threads without a lock: a read torn by the
        training thread answers None."""
        try:
            step = self.step
            if step is None:
                return None
            container = self._batch
            for rec in reversed(list(self._stack)):
                if rec is not container and rec.end < 0:
                    return step.marks[rec.start]
        except (AttributeError, IndexError, TypeError):
            pass
        return None

    def _stamp(self) -> tuple:
        """(device token, host ns) of a boundary outside any step's marks yet."""
        timer_mark = self._timer_mark
        return (timer_mark() if timer_mark is not None else None), self._clock()

    def _push(self, step: StepTimeline, token: Any, now: int) -> None:
        if self._timer_mark is not None:
            step.tokens.append(token)
        step.marks.append(now)

    def _open(self, name: str, auto: bool, at: int | None = None) -> PhaseRecord:
        step = self.step
        if at is None:  # _mark(), inlined: this runs at most boundaries
            if self._timer_mark is not None:
                step.tokens.append(self._timer_mark())
            marks = step.marks
            marks.append(self._clock())
            at = len(marks) - 1
        stack = self._stack
        if stack:
            up = stack[-1]
            rec = PhaseRecord(name, up.name, at, auto, up)
        else:
            rec = PhaseRecord(name, _STEP, at, auto, None)
        step.phases.append(rec)
        stack.append(rec)
        return rec

    def _close_batch(self) -> None:
        batch = self._batch
        if batch is not None and self._stack and self._stack[-1] is batch:
            self._stack.pop()
            batch.end = self._batch_end
            self._batch = None

    def _close_down_to(self, i: int) -> int:
        """End the open phases from the innermost down to ``self._stack[i]`` at one
        new mark (phases left open inside the one being closed); returns it."""
        stack = self._stack
        end = self._mark()
        while len(stack) > i:
            stack.pop().end = end
        return end

    def begin_phase(self, name: str, auto: bool = False) -> bool:
        """Open a phase; auto phases (from hooks) do not nest inside other auto
        phases, so ``.item()`` inside an optimizer is part of the optimizer."""
        step = self.step
        if step is None:
            return False
        stack = self._stack
        top = stack[-1] if stack else None
        batch = self._batch
        if auto and top is not None and top.auto and top is not batch:
            return False
        self._to_device_from = -1
        if name in CHILDREN:
            if top is None or top is batch:
                if batch is None:
                    rec = self._batch = self._open(BATCH, True)
                    self._open(name, auto, rec.start)
                    return True
        elif top is not None and top is batch and not self._closures:
            # (inside an optimizer.step(closure), the container holds the whole step)
            self._close_batch()
        self._open(name, auto)
        return True

    def end_phase(self, name: str) -> None:
        """Close the innermost open phase called ``name`` (and any left open inside it)."""
        stack = self._stack
        if self.step is None or not stack:
            return
        if stack[-1].name == name:  # the usual case: the innermost phase
            if self._timer_mark is None:  # _mark_host(), inlined: every phase ends here
                marks = self.step.marks
                marks.append(self._clock())
                end = stack.pop().end = len(marks) - 1
            else:
                end = stack.pop().end = self._mark()
        else:
            for i in range(len(stack) - 2, -1, -1):
                if stack[i].name == name:
                    break
            else:
                return
            end = self._close_down_to(i)
        if name in CHILDREN and self._batch is not None:
            self._batch_end = end

    def end_record(self, rec: PhaseRecord | None) -> None:
        """Close exactly ``rec`` (and anything still open inside it)."""
        if rec is None or rec.end >= 0 or self.step is None:
            return
        stack = self._stack
        if stack and stack[-1] is rec:  # the usual case: the innermost
            if self._timer_mark is None:  # _mark_host(), inlined
                marks = self.step.marks
                marks.append(self._clock())
                end = rec.end = len(marks) - 1
            else:
                end = rec.end = self._mark()
            stack.pop()
        else:
            for i in range(len(stack) - 2, -1, -1):
                if stack[i] is rec:
                    break
            else:
                return
            end = self._close_down_to(i)
        if rec.name in CHILDREN and self._batch is not None:
            self._batch_end = end


_is_grad_enabled: Callable[[], bool] | None = None


def grad_enabled() -> bool:
    # torch is imported on first use, not with this module (the CLI needs no torch).
    global _is_grad_enabled
    if _is_grad_enabled is None:
        try:
            from torch import is_grad_enabled
        except Exception:  # pragma: no cover - torch missing (the manual API alone)
            return True
        _is_grad_enabled = is_grad_enabled
    return _is_grad_enabled()
