"""The open step's marks and phase stack: how a timeline is written.

``PhaseStack`` owns the step being recorded (``step``), the stack of open phases and
the open train/eval container. The ``Tracker`` (tracker.py) holds one and decides,
from the hooks' events, when steps begin and end and which phases open; this module
only writes marks and phase records. Training thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from otel_training import semconv as sc
from otel_training.record.memory import MemoryReader
from otel_training.record.timeline import PhaseRecord, StepTimeline
from otel_training.timing.device import DeviceTimer

BATCH = "batch"  # internal name of the train_batch/eval_batch container
_STEP = sc.SPAN_STEP
CHILDREN = frozenset(sc.BATCH_CHILDREN)  # phases that open inside the container


class PhaseStack:
    """Marks and phase records of the step being recorded."""

    def __init__(
        self,
        timer: DeviceTimer,
        sink: Callable[[StepTimeline], None],
        clock=time.perf_counter_ns,
        memory: MemoryReader | None = None,
    ) -> None:
        self.timer = timer
        self.sink = sink  # finished pieces go here (the StepAssembler's ``add``)
        self.after_step: Callable[[], None] | None = None  # called after each piece is handed on
        self.memory = memory  # read at step ends, when due
        # Bound once: called at every boundary. A timer that does not override
        # mark() (host clocks only) always returns None: no tokens are kept at all.
        # One that is inert for now (``auto`` before the program initializes CUDA, as
        # in a CPU loop on a GPU machine) is asked when a step begins instead of at
        # every boundary: ``waiting_timer``.
        host_only = type(timer).mark is DeviceTimer.mark
        self.waiting_timer: DeviceTimer | None = None if host_only or timer.observes_device else timer
        self.timer_mark = None if host_only or self.waiting_timer is not None else timer.mark
        if self.timer_mark is None:
            self.mark = self._mark_host  # type: ignore[method-assign]
        self.clock = clock
        self.step: StepTimeline | None = None
        self.stack: list[PhaseRecord] = []
        self.batch: PhaseRecord | None = None  # open container, if any
        self.batch_end = -1  # mark of the container's last child end
        self.to_device_from = -1  # mark where a pending to_device window began
        self.closures = 0  # optimizer-step closures running now

    # -- the open piece -----------------------------------------------------------------
    def new_step(self, source: Any = None, epoch: int | None = None) -> StepTimeline:
        """Begin recording a piece (its first mark is the caller's)."""
        step = StepTimeline(-1, epoch, source)
        self.step = step
        if self.waiting_timer is not None:
            self.start_device_timing()
        self.reset_piece()
        return step

    def reset_piece(self) -> None:
        """The phase state a new piece begins with."""
        if self.stack:  # (a step that closed left it empty: no new list each step)
            self.stack = []
        self.batch = None
        self.batch_end = -1
        self.to_device_from = -1

    def close_step(self, token: Any, now: int) -> None:
        """End the open piece at ``(token, now)``, close what it left open (an
        exception, a break; the container after an update) and hand it on."""
        step = self.step
        self.push(step, token, now)
        marks = step.marks
        stack = self.stack
        batch = self.batch
        if stack:
            end = len(marks) - 1
            for rec in stack:
                if rec.end < 0:
                    rec.end = self.batch_end if rec is batch and self.batch_end >= 0 else end
            self.stack = []
        if batch is not None and batch.end < 0:
            batch.end = self.batch_end if self.batch_end >= 0 else len(marks) - 1
        self.step = None
        self.batch = None
        memory = self.memory
        if memory is not None and now >= memory.due:  # at most every few ms: see record/memory.py
            step.memory = memory.read(now)
        self.sink(step)
        after = self.after_step
        if after is not None:
            after()

    def hand_on_repeated(
        self, step: StepTimeline, now: int, flags: tuple, optimizers: tuple | None, layout: int | None
    ) -> None:
        """The repeat mode finished ``step`` at ``now`` from its template (``flags``, the
        optimizers stepped, the layout's number: record/repeats.py): handed on as
        ``close_step`` hands a piece on, and the next piece begins at the same instant."""
        (
            step.saw_backward,
            step.saw_optimizer,
            step.saw_forward,
            step.train_forward,
            step.backwards,
            step.closure_backward,
            step.updates,
            step.skipped,
            step.microbatches,
        ) = flags
        if optimizers is not None:
            step.optimizers = list(optimizers)
        step.layout_id = layout
        self.step = None
        memory = self.memory
        if memory is not None and now >= memory.due:
            step.memory = memory.read(now)
        self.sink(step)
        after = self.after_step
        if after is not None:
            after()
        new = StepTimeline(-1, step.epoch, step.source)
        new.marks.append(now)
        self.step = new

    def abandon(self) -> None:
        """Forget the open piece (a forked child: its tokens belong to the parent's timer)."""
        self.step = None

    def restart_piece(self) -> None:
        """The open piece starts over from its first mark, its phases unrecorded."""
        self.step.phases.clear()
        self.reset_piece()

    def resume(self, rec: PhaseRecord) -> None:
        """``rec`` (the last phase, ended at the last mark) goes on: open again, innermost."""
        rec.end = -1
        self.stack.append(rec)

    def use_clock(self, clock: Callable[[], int]) -> Callable[[], int]:
        """Read ``clock`` from now on; returns the one it replaces."""
        previous, self.clock = self.clock, clock
        return previous

    def call_after_steps(self, after: Callable[[], None] | None) -> None:
        """Call ``after`` once each piece is handed on (None: nothing)."""
        self.after_step = after

    def closure_began(self) -> None:
        """An optimizer step's closure runs: the container holds the whole step."""
        self.closures += 1

    def closure_ended(self) -> None:
        self.closures -= 1

    def to_device_may_begin(self) -> None:
        """A batch arrived with no phase open: a forward may follow a to_device window
        that began at the last mark."""
        self.to_device_from = len(self.step.marks) - 1

    def open_container(self, at: int) -> PhaseRecord:
        """Open the train/eval container at mark ``at``."""
        rec = self.batch = self.open(BATCH, True, at)
        return rec

    def close_to_device(self) -> int:
        """The pending to_device window ends now, as a phase of its own; the mark it ends at."""
        step = self.step
        rec = PhaseRecord(sc.PHASE_TO_DEVICE, _STEP, self.to_device_from, True)
        rec.end = at = self.mark()
        step.phases.append(rec)
        self.to_device_from = -1
        return at

    def discard(self) -> None:
        """Drop the open piece (its device tokens go back to the timer)."""
        step = self.step
        self.step = None
        self.stack = []
        self.batch = None
        if step is not None and hasattr(self.timer, "release"):
            self.timer.release(step.tokens)

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
            self.timer_mark = timer.mark
            self.__dict__.pop("mark", None)  # back to the class's token-keeping mark()

    def _mark_host(self) -> int:
        """``_mark`` for a timer that keeps no tokens."""
        marks = self.step.marks
        marks.append(self.clock())
        return len(marks) - 1

    def mark(self) -> int:
        """Record a boundary in the current step: its index in ``marks``."""
        step = self.step
        timer_mark = self.timer_mark
        if timer_mark is not None:
            step.tokens.append(timer_mark())
        marks = step.marks
        marks.append(self.clock())
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
            container = self.batch
            for rec in reversed(list(self.stack)):
                if rec is not container and rec.end < 0:
                    return step.marks[rec.start]
        except (AttributeError, IndexError, TypeError):
            pass
        return None

    def stamp(self) -> tuple:
        """(device token, host ns) of a boundary outside any step's marks yet."""
        timer_mark = self.timer_mark
        return (timer_mark() if timer_mark is not None else None), self.clock()

    def push(self, step: StepTimeline, token: Any, now: int) -> None:
        if self.timer_mark is not None:
            step.tokens.append(token)
        step.marks.append(now)

    def open(self, name: str, auto: bool, at: int | None = None) -> PhaseRecord:
        step = self.step
        if at is None:  # mark(), inlined: this runs at most boundaries
            if self.timer_mark is not None:
                step.tokens.append(self.timer_mark())
            marks = step.marks
            marks.append(self.clock())
            at = len(marks) - 1
        stack = self.stack
        if stack:
            outer = stack[-1]
            rec = PhaseRecord(name, outer.name, at, auto, outer)
        else:
            rec = PhaseRecord(name, _STEP, at, auto, None)
        step.phases.append(rec)
        stack.append(rec)
        return rec

    def waited(self, name: str, since: int) -> None:
        """A child phase ``name`` of the innermost open phase, from host ns ``since``
        (clamped to the last mark: marks stay in order) to a new mark now."""
        step = self.step
        stack = self.stack
        if step is None or not stack:
            return
        marks = step.marks
        outer = stack[-1]
        if self.timer_mark is not None:  # (the device token of the past boundary is taken now)
            step.tokens.append(self.timer_mark())
        marks.append(max(since, marks[-1]))
        rec = PhaseRecord(name, outer.name, len(marks) - 1, True, outer)
        step.phases.append(rec)
        rec.end = self.mark()

    def close_batch(self) -> None:
        batch = self.batch
        if batch is not None and self.stack and self.stack[-1] is batch:
            self.stack.pop()
            batch.end = self.batch_end
            self.batch = None

    def _close_down_to(self, i: int) -> int:
        """End the open phases from the innermost down to ``self.stack[i]`` at one
        new mark (phases left open inside the one being closed); returns it."""
        stack = self.stack
        end = self.mark()
        while len(stack) > i:
            stack.pop().end = end
        return end

    def begin_phase(self, name: str, auto: bool = False) -> bool:
        """Open a phase; auto phases (from hooks) do not nest inside other auto
        phases, so ``.item()`` inside an optimizer is part of the optimizer."""
        step = self.step
        if step is None:
            return False
        stack = self.stack
        top = stack[-1] if stack else None
        batch = self.batch
        if auto and top is not None and top.auto and top is not batch:
            return False
        self.to_device_from = -1
        if name in CHILDREN:
            if top is None or top is batch:
                if batch is None:
                    rec = self.batch = self.open(BATCH, True)
                    self.open(name, auto, rec.start)
                    return True
        elif top is not None and top is batch and not self.closures:
            # (inside an optimizer.step(closure), the container holds the whole step)
            self.close_batch()
        self.open(name, auto)
        return True

    def end_phase(self, name: str) -> None:
        """Close the innermost open phase called ``name`` (and any left open inside it)."""
        stack = self.stack
        if self.step is None or not stack:
            return
        if stack[-1].name == name:  # the usual case: the innermost phase
            if self.timer_mark is None:  # _mark_host(), inlined: every phase ends here
                marks = self.step.marks
                marks.append(self.clock())
                end = stack.pop().end = len(marks) - 1
            else:
                end = stack.pop().end = self.mark()
        else:
            for i in range(len(stack) - 2, -1, -1):
                if stack[i].name == name:
                    break
            else:
                return
            end = self._close_down_to(i)
        if name in CHILDREN and self.batch is not None:
            self.batch_end = end

    def end_record(self, rec: PhaseRecord | None) -> None:
        """Close exactly ``rec`` (and anything still open inside it)."""
        if rec is None or rec.end >= 0 or self.step is None:
            return
        stack = self.stack
        if stack and stack[-1] is rec:  # the usual case: the innermost
            if self.timer_mark is None:  # _mark_host(), inlined
                marks = self.step.marks
                marks.append(self.clock())
                end = rec.end = len(marks) - 1
            else:
                end = rec.end = self.mark()
            stack.pop()
        else:
            for i in range(len(stack) - 2, -1, -1):
                if stack[i] is rec:
                    break
            else:
                return
            end = self._close_down_to(i)
        if rec.name in CHILDREN and self.batch is not None:
            self.batch_end = end


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
