"""The training thread's recorder: hook events in, timeline pieces out.

Hooks report events through ``TrainingEvents`` (events.py) to one ``Tracker``. It
decides what each event means for the step -- where a piece begins and ends (a
DataLoader batch, a forward after an optimizer update, an eval forward, a closure
step, a framework's fetch, the user's ``step()``) and which phase opens -- and
writes that into the parts it owns: the open piece's marks and phases
(``PhaseStack``), the optimizer steps under way (``OptimizerSteps``), named time
between steps (``NamedBetween``). Each finished piece goes to the ``StepAssembler``,
which applies the step definition (docs/steps.md). A loop that repeats one piece is
recorded by a mode the tracker delegates its events to (``Repeats``, repeats.py).
Everything runs on the training thread, so it stays small: no OpenTelemetry calls,
no allocation beyond the step's lists.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from otel_training import semconv as sc
from otel_training.record.events import DRIVER_DATALOADER, DRIVER_MANUAL, DRIVER_NONE
from otel_training.record.forward_steps import ForwardSteps
from otel_training.record.loader_steps import LoaderSteps
from otel_training.record.memory import MemoryReader
from otel_training.record.named_between import NamedBetween
from otel_training.record.optimizer_steps import OptimizerSteps
from otel_training.record.phase_stack import PhaseStack
from otel_training.record.repeat_learning import Template
from otel_training.record.repeats import LEARN_AFTER, Repeats
from otel_training.record.run_facts import RunFacts
from otel_training.record.step_assembly import StepAssembler
from otel_training.record.timeline import PhaseRecord, StepTimeline, has_work
from otel_training.timing.device import DeviceTimer

_FORWARD = sc.PHASE_FORWARD
_BACKWARD = sc.PHASE_BACKWARD
_MAIN_THREAD = threading.main_thread().ident
_get_ident = threading.get_ident
_NOBODY = -1  # a thread ident no thread has: every hook is ignored


class Tracker:
    """Turns hook events on the training thread into step timelines (implements ``TrainingEvents``)."""

    def __init__(
        self,
        assembler: StepAssembler,
        timer: DeviceTimer,
        clock: Callable[[], int] = time.perf_counter_ns,
        memory: MemoryReader | None = None,
    ):
        self.assembler = assembler
        self.phases = PhaseStack(timer, assembler.add, clock, memory)
        self._optimizer_steps = OptimizerSteps(self.phases, assembler.alive)
        self._between = NamedBetween(self.phases, assembler.add_between)
        # called when a DataLoader loop begins or ends (model discovery looks again)
        self.on_loop: Callable[[], None] | None = None
        self.driver = DRIVER_NONE
        self.thread: int | None = None  # the training thread's ident
        self.facts = RunFacts()  # what the run already does (loader settings, autocast ...)
        self._loader_steps = LoaderSteps(self)
        self._forward_steps = self._loader_steps.forwards = ForwardSteps(self, assembler)
        self.grad_enabled = self._forward_steps.grad_enabled  # torch's, read once
        # A loop that repeats one piece: DataLoader pieces opened before its mode learns it.
        self.repeats = Repeats(self)
        self.mode: Repeats | None = None  # while set, the hot events go to it first
        self._learn_in = LEARN_AFTER or -1

    # ------------------------------------------------------------------ basics
    @property
    def step(self) -> StepTimeline | None:
        """The piece being recorded (read from any thread)."""
        return self.phases.step

    def on_training_thread(self, bind: bool = False) -> bool:
        """True on the thread we track. Until one is known, the main thread is it;
        another thread becomes it only through compute (``bind``: a forward, a
        backward, an optimizer step) -- not by iterating a DataLoader, which a
        prefetch thread may do first."""
        ident = _get_ident()
        if self.thread is None:
            if bind or ident == _MAIN_THREAD:
                self.thread = ident
                return True
            return False
        return ident == self.thread

    @property
    def unstepped(self) -> int:
        """Model work seen with no step open: evidence of a loop steps do not cover."""
        return self._forward_steps.unstepped + self._optimizer_steps.unstepped

    def now(self) -> int:
        """The tracker's clock (host ns)."""
        return self.phases.clock()

    def use_clock(self, clock: Callable[[], int]) -> Callable[[], int]:
        """Read ``clock`` from now on; returns the one it replaces."""
        return self.phases.use_clock(clock)

    def open_phase_start(self) -> int | None:
        """Host ns at which the innermost phase still open began (named time between
        steps included); None outside phases. Read from other threads."""
        mode = self.mode
        if mode is not None and mode.repeating:
            return mode.open_phase_start()
        start = self.phases.open_phase_start()
        if start is None and self.phases.step is None:
            return self._between.open_start()
        return start

    def _settle(self) -> None:
        """An event the repeat mode does not take: the state machine handles it."""
        mode = self.mode
        if mode is not None:
            mode.interrupt()

    def direct(self, event: str, *args: Any) -> Any:
        """Run ``event`` through the state machine itself (the repeat mode's learning
        and replay)."""
        mode, self.mode = self.mode, None
        try:
            return getattr(self, event)(*args)
        finally:
            self.mode = mode

    def delegate(self, mode: Repeats | None) -> None:
        """Send the hot events to ``mode`` first (None: the state machine takes them)."""
        self.mode = mode

    def replay(self, calls: list, readings: list) -> None:
        """The open piece is recorded again from its first mark, call by call, with
        the clock readings already taken (the repeat mode left mid-piece)."""
        self.phases.step.restart()  # its batch is read again by the replay
        self.reset_piece()
        self.phases.open(sc.PHASE_DATALOADER_NEXT, True, 0)
        real = self.use_clock(iter(readings).__next__)
        try:
            for event, args in calls:
                getattr(self, event)(*args)
        finally:
            self.use_clock(real)

    def learn_in(self, pieces: int) -> None:
        """The repeat mode learns after ``pieces`` more DataLoader pieces (-1: never)."""
        self._learn_in = pieces

    def piece_opened_by_loader(self) -> None:
        """A loader's batch opened a piece: the repeat mode may begin learning."""
        self._learn_in -= 1
        if not self._learn_in:
            self.repeats.begin()

    def repeated_piece_ended(self, step: StepTimeline, now: int, template: Template) -> None:
        """The repeat mode finished ``step`` at ``now`` from its template: handed on,
        and the next piece begins at the same instant."""
        self._loader_steps.fetched(step)
        self.phases.hand_on_repeated(step, now, template.flags, template.optimizers, template.layout_id)

    def new_piece(self, source: Any = None, epoch: int | None = None) -> StepTimeline:
        """Begin recording a piece (its first mark is the caller's)."""
        step = self.phases.new_step(source, epoch)
        self._reset_roots()
        return step

    def _reset_roots(self) -> None:
        self._forward_steps.reset()
        self._optimizer_steps.reset()

    def reset_piece(self) -> None:
        """The open piece starts over from its first mark (the repeat mode's replay)."""
        self.phases.restart_piece()
        self._reset_roots()

    def close_piece(self, token: Any, now: int) -> None:
        """End the open piece at ``(token, now)`` and hand it on."""
        self._optimizer_steps.reset()
        self.phases.close_step(token, now)

    # ------------------------------------------------------------------ steps
    def start_step(self, driver: str = DRIVER_MANUAL, source: Any = None, epoch: int | None = None) -> None:
        """Begin a piece now, ending any open one at the same instant. The user's
        ``step()`` (``DRIVER_MANUAL``) is a step as it is; any other driver's piece
        is grouped into steps by the assembler."""
        self._settle()
        step = self.phases.step
        if (
            step is not None
            and (
                (driver == DRIVER_MANUAL and not step.manual and self.driver == DRIVER_DATALOADER)
                or step is self._forward_steps.outside
            )
            and not has_work(step)
        ):
            # ``for batch in loader: with step():`` -- the user's step is the block; the wait before
            # it lies outside (coverage counts it), as a framework callback's read no model work used.
            self.discard_step()
        self.driver = driver
        self.thread = threading.get_ident()
        token, now = self.phases.stamp()
        if self.phases.step is not None:
            self.close_piece(token, now)
        step = self.new_piece(source, epoch)
        step.mark_manual(driver == DRIVER_MANUAL)
        self.phases.push(step, token, now)

    def finish_step(self, error: BaseException | None = None) -> None:
        """End the current step now (no-op without one)."""
        self._settle()
        if self.phases.step is None:
            return
        if error is not None:
            self.phases.record_error(error)
        self.close_piece(*self.phases.stamp())

    def discard_step(self) -> None:
        """Drop the current piece (a framework's fetch that held no work)."""
        self._settle()
        self.phases.discard()

    def claim_driver(self, driver: str) -> None:
        """A framework integration drives steps from now on (DataLoader iteration no
        longer starts or ends them), even before its first step begins."""
        self._settle()
        self.driver = driver

    def record_error(self, exc: BaseException) -> None:
        self._settle()
        self.phases.record_error(exc)

    def disable(self) -> None:
        """Ignore every hook from now on (a forked child, a DataLoader worker)."""
        self.repeats.leave()
        self.thread = _NOBODY
        self.phases.abandon()
        self._between.drop()

    def close(self) -> None:
        """The run ends: the open piece, named time between steps still open, and
        whatever the assembler holds are handed on."""
        self._settle()
        if self.phases.step is not None:
            self.finish_step()
        self._between.end_all()
        self.assembler.close()

    # ------------------------------------------------------------------ phases
    def begin_phase(self, name: str, auto: bool = False) -> bool:
        mode = self.mode
        if mode is not None:
            return mode.begin_phase(name, auto)
        return self.phases.begin_phase(name, auto)

    def end_phase(self, name: str) -> None:
        mode = self.mode
        if mode is not None:
            return mode.end_phase(name)
        self.phases.end_phase(name)

    def end_record(self, rec: PhaseRecord | None) -> None:
        self._settle()
        self.phases.end_record(rec)

    def waited(self, name: str, since: int) -> None:
        self._settle()
        self.phases.waited(name, since)

    def begin_between(self, name: str) -> PhaseRecord | None:
        self._settle()
        return self._between.begin(name)

    def end_between(self, rec: PhaseRecord, error: BaseException | None = None) -> None:
        self._settle()
        self._between.end(rec, error)

    # ---------------------------------------------------------------- data loading
    @property
    def loaders(self) -> frozenset[str]:
        """Kinds of loader whose loops this thread began ("torch", "grain")."""
        return self._loader_steps.kinds

    def loader_iter_begin(self, kind: str = "torch") -> tuple:
        self._settle()
        return self._loader_steps.iter_begin(kind)

    def loader_opened(self, loader: Any) -> None:
        self.facts.loader(loader)

    def loader_next_begin(self, iterator: Any, started_at: tuple | None = None) -> bool:
        mode = self.mode
        if mode is not None:
            return mode.loader_next_begin(iterator, started_at)
        return self._loader_steps.next_begin(iterator, started_at)

    def loader_next_end(self, batch: Any) -> None:
        mode = self.mode
        if mode is not None:
            return mode.loader_next_end(batch)
        self._loader_steps.next_end(batch)

    def loader_stopped(self, wrapped: bool = False) -> None:
        self._settle()
        self._loader_steps.stopped(wrapped)

    def loop_ended(self) -> None:
        self._settle()
        self._loader_steps.loop_ended()

    # ---------------------------------------------------------------------- compute
    def forward_begin(self, root: Any = None, loss: bool = False) -> None:
        mode = self.mode
        if mode is not None:
            return mode.forward_begin(root, loss)
        self._forward_steps.begin(root, loss)

    def forward_inputs(self, root: Any, args: tuple, kwargs: dict | None) -> None:
        self._settle()
        self._forward_steps.inputs(root, args, kwargs)

    def optimizer_running(self) -> bool:
        """Whether an optimizer step is under way (its closure's forward and backward)."""
        return bool(self._optimizer_steps.pending)

    def in_backward(self) -> bool:
        """Whether a backward pass is running: activation checkpointing recomputes its
        segments' forwards in it (and, reentrant, calls ``backward`` again), which are
        part of that backward -- no forward, root module or micro-batch of their own."""
        self._settle()
        stack = self.phases.stack
        return bool(stack) and stack[-1].name == _BACKWARD

    def backward_begin(self) -> bool:
        mode = self.mode
        if mode is not None:
            return mode.backward_begin()
        phases = self.phases
        step = phases.step
        if step is None:
            return False
        stack = phases.stack
        if stack and stack[-1].name == _BACKWARD:
            return False  # reentrant checkpointing: a backward inside the backward pass
        step.backward_ran(bool(self._optimizer_steps.pending))  # inside an optimizer step: its closure
        return phases.begin_phase(_BACKWARD, auto=True)

    # ------------------------------------------------------------------- optimizers
    def optimizer_created(self, optimizer: Any) -> None:
        # Optimizers alive decide what a step is: with one, backward passes without an
        # update are gradient accumulation (see step_assembly.py).
        self.assembler.optimizer_created(optimizer)
        self.facts.optimizer(optimizer)

    def closure_step_begin(self) -> None:
        """``optimizer.step(closure)`` is about to run: its forward and backward run
        inside it, so an update with a closure begins a piece of its own where a
        forward would (LBFGS: one step per ``step(closure)``)."""
        self._settle()
        if self._optimizer_steps.pending or self.driver not in (DRIVER_NONE, DRIVER_DATALOADER):
            return
        step = self.phases.step
        if step is None or (
            self.driver == DRIVER_NONE
            and (step.saw_optimizer or (step.saw_forward and not step.train_forward and not step.saw_backward))
        ):
            self.start_step(DRIVER_NONE)

    def optimizer_pre(self, optimizer: Any, frame: Any = None) -> None:
        mode = self.mode
        if mode is not None:
            return mode.optimizer_pre(optimizer, frame)
        self._optimizer_steps.pre(optimizer, frame)

    def optimizer_post(self, optimizer: Any) -> None:
        mode = self.mode
        if mode is not None:
            return mode.optimizer_post(optimizer)
        self._optimizer_steps.post(optimizer)

    def optimizer_begin(self) -> PhaseRecord | None:
        self._settle()
        return self._optimizer_steps.begin()

    def wrap_closure(self, optimizer: Any, closure: Callable) -> Callable:
        self._settle()
        return self._optimizer_steps.wrap_closure(optimizer, closure)
