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

import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from otel_training import semconv as sc
from otel_training.record.batches import read_batch, read_inputs
from otel_training.record.events import DRIVER_DATALOADER, DRIVER_MANUAL, DRIVER_NONE
from otel_training.record.named_between import NamedBetween
from otel_training.record.optimizer_steps import OptimizerSteps
from otel_training.record.phase_stack import BATCH, PhaseStack, grad_enabled
from otel_training.record.repeats import LEARN_AFTER, Repeats
from otel_training.record.run_facts import RunFacts
from otel_training.record.step_assembly import BOUNDARY_FORWARD, StepAssembler
from otel_training.record.timeline import PhaseRecord, StepTimeline, has_work

_FORWARD = sc.PHASE_FORWARD
_BACKWARD = sc.PHASE_BACKWARD
_ITER_GAP_NS = 5_000_000  # iter(loader) this close before its first next(): one wait
_MAIN_THREAD = threading.main_thread().ident
_get_ident = threading.get_ident
_NOBODY = -1  # a thread ident no thread has: every hook is ignored


def _gone() -> None:
    """A weak reference's answer once its object is gone."""
    return None


class Tracker:
    """Turns hook events on the training thread into step timelines
    (implements ``TrainingEvents``)."""

    def __init__(self, assembler: StepAssembler, timer: Any, clock: Callable[[], int] = time.perf_counter_ns):
        self.assembler = assembler
        self._forward_boundary = assembler.boundary == BOUNDARY_FORWARD
        self.phases = PhaseStack(timer, assembler.add, clock)
        self._optimizer_steps = OptimizerSteps(self.phases, assembler.alive)
        self._between = NamedBetween(self.phases, assembler.add_between)
        # called when a DataLoader loop begins or ends (model discovery looks again)
        self.on_loop: Callable[[], None] | None = None
        torch = sys.modules.get("torch")  # the manual API needs no torch
        self._grad_enabled = getattr(torch, "is_grad_enabled", None) or grad_enabled
        self._step_root: Any = None  # the first root module called in the step
        self._forward_root: Any = None  # the root that opened the last forward phase
        self._last_root: Any = None  # the last root called (a continuation's too)
        self.driver = DRIVER_NONE
        self.thread: int | None = None  # the training thread's ident
        # kinds of loader whose loops this thread began ("torch", "grain"); replaced, never
        # mutated, so the summary reads it from another thread
        self.loaders: frozenset[str] = frozenset()
        self.facts = RunFacts()  # what the run already does (loader settings, autocast ...)
        self._fetched: StepTimeline | None = None  # the piece of the last batch a DataLoader handed out
        self._source_id = 0  # id() of the DataLoader iterator that began the last piece, and
        self._source: Callable[[], Any] = _gone  # a weak reference to it
        # A loop that repeats one piece: DataLoader pieces opened before its mode learns it.
        self.repeats = Repeats(self)
        self.mode: Repeats | None = None  # while set, the hot events go to it first
        self._learn_in = LEARN_AFTER or -1

    # ------------------------------------------------------------------ basics
    @property
    def step(self) -> StepTimeline | None:
        """The piece being recorded (read from any thread)."""
        return self.phases.step

    @property
    def after_step(self) -> Callable[[], None] | None:
        """Called after each piece is handed on."""
        return self.phases.after_step

    @after_step.setter
    def after_step(self, callback: Callable[[], None] | None) -> None:
        self.phases.after_step = callback

    @property
    def memory(self) -> Any:
        """A MemoryReader (record/memory.py), read at step ends when due."""
        return self.phases.memory

    @memory.setter
    def memory(self, reader: Any) -> None:
        self.phases.memory = reader

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

    def now(self) -> int:
        """The tracker's clock (host ns)."""
        return self.phases.clock()

    def use_clock(self, clock: Callable[[], int]) -> Callable[[], int]:
        """Read ``clock`` from now on; returns the one it replaces."""
        previous, self.phases.clock = self.phases.clock, clock
        return previous

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
        step = self.phases.step
        del step.marks[1:]
        step.batch_size = step.token_count = step.token_masks = None  # read again by the replay
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

    def _new_step(self, source: Any = None, epoch: int | None = None) -> StepTimeline:
        step = self.phases.new_step(source, epoch)
        self._reset_roots()
        return step

    def _reset_roots(self) -> None:
        self._step_root = None
        self._forward_root = None
        self._last_root = None
        self._optimizer_steps.reset()

    def reset_piece(self) -> None:
        """The open piece starts over from its first mark (the repeat mode's replay)."""
        phases = self.phases
        phases.step.phases.clear()
        phases.reset_piece()
        self._reset_roots()

    def _close(self, token: Any, now: int) -> None:
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
            driver == DRIVER_MANUAL
            and step is not None
            and not step.manual
            and self.driver == DRIVER_DATALOADER
            and not has_work(step)
        ):
            # ``for batch in loader: with step():`` -- the user's step is the block;
            # the wait that opened a piece before it lies outside (coverage counts it).
            self.discard_step()
        self.driver = driver
        self.thread = threading.get_ident()
        token, now = self.phases.stamp()
        if self.phases.step is not None:
            self._close(token, now)
        step = self._new_step(source, epoch)
        step.manual = driver == DRIVER_MANUAL
        self.phases.push(step, token, now)

    def finish_step(self, error: BaseException | None = None) -> None:
        """End the current step now (no-op without one)."""
        self._settle()
        if self.phases.step is None:
            return
        if error is not None:
            self.phases.record_error(error)
        self._close(*self.phases.stamp())

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
        self.phases.step = None
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

    def begin_between(self, name: str) -> PhaseRecord | None:
        self._settle()
        return self._between.begin(name)

    def end_between(self, rec: PhaseRecord, error: BaseException | None = None) -> None:
        self._settle()
        self._between.end(rec, error)

    # ---------------------------------------------------------------- data loading
    def loader_iter_begin(self, kind: str = "torch") -> tuple:
        """``DataLoader.__iter__`` entered (or another ``kind`` of loader's iterator
        made): a new loop ends the open step (unless a manual ``step()`` drives).
        Returns the instant, ``(token, ns)``, from which the loop's first step counts
        (so worker start-up lands in its first wait)."""
        self._settle()
        if kind not in self.loaders:
            self.loaders = self.loaders | {kind}
        token, now = self.phases.stamp()
        step = self.phases.step
        if step is not None and self.driver in (DRIVER_NONE, DRIVER_DATALOADER):
            if (
                step.source is not None
                and step.source == self._source_id
                and not (step.saw_forward or step.saw_backward or step.saw_optimizer)
                and self._source() is None
            ):
                # A loop left with ``break`` after one more fetch (Fabric's
                # ``limit_batches`` check): that batch feeds no step, and the time until
                # this loop (an epoch-end log's ``.item()``) lies between steps, as after
                # a loader's end.
                self.phases.discard()
            if self.phases.step is not None:
                self._close(token, now)  # a framework or manual driver keeps its step
        if self.on_loop is not None:
            self.on_loop()
        return token, now

    def loader_opened(self, loader: Any) -> None:
        self.facts.loader(loader)

    def loader_next_begin(self, iterator: Any, started_at: tuple | None = None) -> bool:
        """A DataLoader iterator's ``__next__`` was entered; True if recording."""
        mode = self.mode
        if mode is not None:
            return mode.loader_next_begin(iterator, started_at)
        phases = self.phases
        if self.driver not in (DRIVER_NONE, DRIVER_DATALOADER):
            return phases.begin_phase(sc.PHASE_DATALOADER_NEXT, auto=True)
        step = phases.step
        # A new batch: the same loader again, or another loader once the piece holds
        # work other than a training forward still waiting for its backward. Otherwise
        # another wait of the same step: zip(loader_a, loader_b), or a second loader
        # read mid-iteration (a target-domain batch after the source forward).
        new = (
            step is None
            or step.source == id(iterator)
            or (
                has_work(step)
                and (step.source is None or step.saw_backward or step.saw_optimizer or not step.train_forward)
            )
        )
        if not new:
            return phases.begin_phase(sc.PHASE_DATALOADER_NEXT, auto=True)
        self.driver = DRIVER_DATALOADER
        token, now = phases.stamp()
        if step is not None:
            self._close(token, now)  # the next step begins where this one ends
        elif started_at is not None and now - started_at[2] < _ITER_GAP_NS:
            # ``for batch in loader``: the iterator's start-up (workers) counts in the
            # first wait -- not when the iterator was made long before its first batch.
            token, now = started_at[0], started_at[1]
        # Only the iterator's id is kept: holding the iterator would keep its worker
        # processes alive after the user's loop let go of it (and fork copies of it).
        # A weak reference tells whether the loop let go of it (loader_iter_begin).
        if self._source() is not iterator:
            self._source_id = id(iterator)
            self._source = weakref.ref(iterator)
        step = self._new_step(id(iterator), getattr(iterator, "_otel_epoch", None))
        phases.push(step, token, now)
        phases.open(sc.PHASE_DATALOADER_NEXT, True, 0)
        self._learn_in -= 1
        if not self._learn_in:
            self.repeats.begin()
        return True

    def loader_next_end(self, batch: Any) -> None:
        mode = self.mode
        if mode is not None:
            return mode.loader_next_end(batch)
        phases = self.phases
        step = phases.step
        if step is None:
            return
        phases.end_phase(sc.PHASE_DATALOADER_NEXT)
        if step.batch_size is None:
            read_batch(batch, step)
        self._fetched = step
        if not phases.stack:
            phases.to_device_from = len(step.marks) - 1

    def repeated_piece_ended(self, step: StepTimeline, now: int) -> None:
        """The repeat mode finished ``step`` at ``now`` from its template: handed on,
        and the next piece begins at the same instant."""
        self._fetched = step
        self.phases.step = None
        self.phases.hand_on(step, now)
        new = StepTimeline(-1, step.epoch, step.source)
        new.marks.append(now)
        self.phases.step = new

    def loader_stopped(self, wrapped: bool = False) -> None:
        """``__next__`` raised StopIteration: a piece with only that wait is no
        step, nor part of one (no batch came of it: the time lies between steps).
        ``wrapped``: in a watched wrapper's loop (record/loop_wrappers.py), which may
        still hand out a batch fetched ahead: the piece stays for it until ``loop_ended``."""
        self._settle()
        if self.on_loop is not None:  # what runs after a loop may call a model not seen yet
            self.on_loop()
        step = self.phases.step
        if step is None:
            return
        if not wrapped and step.source is not None and not has_work(step) and self.driver == DRIVER_DATALOADER:
            self.phases.discard()
            return
        self.phases.end_phase(sc.PHASE_DATALOADER_NEXT)
        last = self._fetched
        if wrapped and step.batch_size is None and last is not None and last is not step:
            # The batch the loop hands out last was fetched by the piece before: its size.
            step.batch_size, step.token_count, step.token_masks = last.batch_size, last.token_count, last.token_masks

    def loop_ended(self) -> None:
        """A watched wrapper's loop ended (its generator returned): the open piece ends
        here, as at a DataLoader's end; a piece with only waits is no step."""
        self._settle()
        step = self.phases.step
        if step is not None and self.driver == DRIVER_DATALOADER:
            if has_work(step):
                self._close(*self.phases.stamp())
            else:
                self.phases.discard()
        if self.on_loop is not None:  # what runs after a loop may call a model not seen yet
            self.on_loop()

    # ---------------------------------------------------------------------- compute
    def forward_begin(self, root: Any = None, loss: bool = False) -> None:
        """A root module's forward began (``root``: that module; ``loss``: it has no
        parameters, a loss module)."""
        mode = self.mode
        if mode is not None:
            return mode.forward_begin(root, loss)
        phases = self.phases
        step = phases.step
        driver = self.driver
        if step is None:
            # No piece open: a loop without a DataLoader (or code after a DataLoader
            # loop ended) -- pieces are cut at forwards. Inside a manual step() loop,
            # time outside step() belongs to no step.
            if driver != DRIVER_NONE and driver != DRIVER_DATALOADER:
                return
            fresh = True
        elif step.saw_forward or step.saw_backward or step.saw_optimizer:
            stack = phases.stack
            top = stack[-1] if stack else None
            if top is not None and top is phases.batch and root is not self._forward_root:
                last = step.phases[-1]
                if loss and last.name == _FORWARD and last.outer is top and last.end == len(step.marks) - 1:
                    # A loss module right after the last forward (nothing timed in
                    # between): the same forward goes on -- one phase, no new mark.
                    # (A model -- the same RNN cell again, a critic after the actor, a
                    # value network after the env step -- is a forward of its own.)
                    last.end = -1
                    stack.append(last)
                    self._last_root = root
                    if not step.train_forward and self._grad_enabled() and getattr(root, "training", True):
                        step.train_forward = True
                    return
            if top is not None and top.name == _BACKWARD:
                return  # a checkpointed segment recomputed by the backward pass: part of it
            fresh = (
                (driver == DRIVER_NONE or driver == DRIVER_DATALOADER)
                and not self._optimizer_steps.pending
                and self._cuts(step, root)
            )
        else:
            fresh = False
        if fresh:  # a piece cut here begins with this forward
            self.start_step(DRIVER_NONE)
            step = phases.step
            phases.batch = phases.open(BATCH, True, 0)
            phases.open(_FORWARD, True, 0)
        elif phases.to_device_from >= 0 and not phases.stack:
            rec = PhaseRecord(sc.PHASE_TO_DEVICE, sc.SPAN_STEP, phases.to_device_from, True)
            rec.end = at = phases.mark()
            step.phases.append(rec)
            phases.to_device_from = -1
            phases.batch = phases.open(BATCH, True, at)
            phases.open(_FORWARD, True, at)
        elif not phases.begin_phase(_FORWARD, auto=True):
            return
        self._forward_root = self._last_root = root
        if self._step_root is None:
            self._step_root = root
        step.saw_forward = True
        if not step.train_forward and self._grad_enabled() and getattr(root, "training", True):
            step.train_forward = True

    def forward_inputs(self, root: Any, args: tuple, kwargs: dict | None) -> None:
        """Samples and tokens of each forward of the step's first root when no DataLoader
        drives (nanoGPT's ``model(x, y)``), outside optimizer steps (LBFGS closures)."""
        self._settle()
        step = self.phases.step
        if (
            step is not None
            and root is self._step_root
            and not self._optimizer_steps.pending
            and not self.in_backward()
        ):
            read_inputs(args, kwargs, step)

    def _cuts(self, step: StepTimeline, root: Any) -> bool:
        """Whether a root forward (not continuing the last) begins a new piece;
        ``step`` already holds work."""
        if self._forward_boundary:
            return True
        if step.saw_optimizer:
            # After an update: the next iteration, an eval forward, or another
            # optimizer's part of the iteration (a GAN's G: the assembler merges it).
            return True
        if step.saw_backward:  # accumulation, unless each backward is a step
            return self.assembler.per_backward
        if self.driver != DRIVER_NONE or step.train_forward:
            return False  # a rollout, a target network under no_grad, the loss module
        # Eval forwards: a root that already ran in the piece begins the next batch.
        return (
            root is self._step_root
            or root is self._last_root
            or (self._grad_enabled() and getattr(root, "training", True))
        )

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
        step.saw_backward = True
        if self._optimizer_steps.pending:  # inside an optimizer step: its closure
            step.closure_backward = True
        elif not step.saw_optimizer:
            step.backwards += 1
        return phases.begin_phase(_BACKWARD, auto=True)

    # ------------------------------------------------------------------- optimizers
    def optimizer_created(self, optimizer: Any) -> None:
        # Optimizers alive decide what a step is: with one, backward passes without an
        # update are gradient accumulation (see step_assembly.py).
        self.assembler.optimizers.add(optimizer)
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
