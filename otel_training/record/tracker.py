"""The training-thread state machine: hook events in, timeline pieces out.

Hooks call into one ``Tracker``; it appends marks and phase records to the
current ``StepTimeline`` and cuts it into *pieces* where a step may end (a
DataLoader batch, a forward after an optimizer update, an eval forward, a
closure step, a framework's fetch, the user's ``step()``). Each finished piece
goes to ``sink``: the ``StepAssembler``, which applies the step definition
(docs/steps.md). Everything here runs on the training thread, so it stays small:
no OpenTelemetry calls, no allocation beyond the step's lists.
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
from otel_training.record.phase_stack import BATCH as _BATCH
from otel_training.record.phase_stack import PhaseStack, grad_enabled
from otel_training.record.run_facts import RunFacts
from otel_training.record.steady import LEARN_AFTER, Steady
from otel_training.record.step_assembly import BOUNDARY_FORWARD, StepAssembler
from otel_training.record.timeline import BetweenSteps, PhaseRecord, StepTimeline, has_work

_FORWARD = sc.PHASE_FORWARD
_BACKWARD = sc.PHASE_BACKWARD

DRIVER_NONE = "none"  # no step source seen yet: implicit steps at forward
DRIVER_DATALOADER = "dataloader"
DRIVER_MANUAL = "manual"
_ITER_GAP_NS = 5_000_000  # iter(loader) this close before its first next(): one wait
_MAIN_THREAD = threading.main_thread().ident
_get_ident = threading.get_ident
_NOBODY = -1  # a thread ident no thread has: every hook is ignored


def _gone() -> None:
    """A weak reference's answer once its object is gone."""
    return None


class Tracker(PhaseStack):
    """Turns hook events on the training thread into step timelines."""

    def __init__(self, sink: Callable[[StepTimeline], None] | StepAssembler, timer: Any, clock=time.perf_counter_ns):
        # The assembler groups pieces into steps; a bare callable gets one of its own.
        if not isinstance(sink, StepAssembler):
            sink = StepAssembler(sink, release=getattr(timer, "release", None))
        self.assembler = sink
        self._sink = sink.add
        self._forward_boundary = sink.boundary == BOUNDARY_FORWARD
        self._alive_optimizers = sink.alive
        super().__init__(timer, clock)
        self.after_step: Callable[[], None] | None = None  # called after each piece is handed over
        # called when a DataLoader loop begins or ends (model discovery looks again)
        self.on_loop: Callable[[], None] | None = None
        torch = sys.modules.get("torch")  # the manual API needs no torch
        self._grad_enabled = getattr(torch, "is_grad_enabled", None) or grad_enabled
        self._step_root: Any = None  # the first root module called in the step
        self._forward_root: Any = None  # the root that opened the last forward phase
        self._last_root: Any = None  # the last root called (a continuation's too)
        self._optimizers: list[tuple] = []  # (optimizer, record or None, frame) awaiting a post-hook
        self.driver = DRIVER_NONE
        self.thread: int | None = None  # the training thread's ident
        self.memory: Any = None  # a MemoryReader (record/memory.py): read at step ends, when due
        # kinds of loader whose loops this thread began ("torch", "grain"); replaced, never
        # mutated, so the summary reads it from another thread
        self.loaders: frozenset[str] = frozenset()
        self.facts = RunFacts()  # what the run already does (loader settings, autocast ...)
        self._fetched: StepTimeline | None = None  # the piece of the last batch a DataLoader handed out
        self._source_id = 0  # id() of the DataLoader iterator that began the last piece, and
        self._source: Callable[[], Any] = _gone  # a weak reference to it
        # A loop that repeats one piece is recorded by its clock readings (record/steady.py):
        # DataLoader pieces opened before it learns the piece.
        self._learn_in = LEARN_AFTER or -1
        # Named time between steps: the user's phases opened with no step open.
        self._between: BetweenSteps | None = None
        self._between_stack: list[PhaseRecord] = []
        self.steady = Steady(self)
        # Model work seen with no step open (forwards a manual or framework driver left
        # out, optimizer steps outside steps): evidence of a loop steps do not cover.
        self.unstepped = 0

    # ------------------------------------------------------------------ basics
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

    def _new_step(self, source: Any = None, epoch: int | None = None) -> StepTimeline:
        step = StepTimeline(-1, epoch, source)
        self.step = step
        if self.waiting_timer is not None:
            self.start_device_timing()
        self._reset_piece_state()
        return step

    def _reset_piece_state(self) -> None:
        """The state a new piece begins with (its phases, roots and optimizers)."""
        if self._stack:  # (a step that closed left them empty: no new lists each step)
            self._stack = []
        self._batch = None
        self._batch_end = -1
        self._to_device_from = -1
        self._step_root = None
        self._forward_root = None
        self._last_root = None
        if self._optimizers:
            self._optimizers = []

    # ------------------------------------------------------------------ steps
    def start_step(self, driver: str = DRIVER_MANUAL, source: Any = None, epoch: int | None = None) -> None:
        """Begin a piece now, ending any open one at the same instant. The user's
        ``step()`` (``DRIVER_MANUAL``) is a step as it is; any other driver's piece
        is grouped into steps by the assembler."""
        step = self.step
        if (
            driver == DRIVER_MANUAL
            and step is not None
            and not step.hard
            and self.driver == DRIVER_DATALOADER
            and not has_work(step)
        ):
            # ``for batch in loader: with step():`` -- the user's step is the block;
            # the wait that opened a piece before it lies outside (coverage counts it).
            self.discard_step()
        self.driver = driver
        self.thread = threading.get_ident()
        token, now = self._stamp()
        if self.step is not None:
            self._close(token, now)
        step = self._new_step(source, epoch)
        step.hard = driver == DRIVER_MANUAL
        self._push(step, token, now)

    def finish_step(self, error: BaseException | None = None) -> None:
        """End the current step now (no-op without one)."""
        if self.step is None:
            return
        if error is not None:
            self.record_error(error)
        self._close(*self._stamp())

    def disable(self) -> None:
        """Ignore every hook from now on (a forked child, a DataLoader worker)."""
        self.thread = _NOBODY
        self.step = None
        self._between = None
        self._between_stack = []

    def now(self) -> int:
        """The tracker's clock (host ns)."""
        return self._clock()

    def _close(self, token: Any, now: int) -> None:
        step = self.step
        self._push(step, token, now)
        marks = step.marks
        stack = self._stack
        if stack:  # phases left open (an exception, a break; the container after an update)
            end = len(marks) - 1
            for rec in stack:
                if rec.end < 0:
                    rec.end = self._batch_end if rec is self._batch and self._batch_end >= 0 else end
            self._stack = []
        if self._batch is not None and self._batch.end < 0:
            self._batch.end = self._batch_end if self._batch_end >= 0 else len(marks) - 1
        self.step = None
        self._batch = None
        if self._optimizers:
            self._optimizers = []
        memory = self.memory
        if memory is not None and now >= memory.due:  # at most every few ms: see record/memory.py
            step.memory = memory.read(now)
        self._sink(step)
        after = self.after_step
        if after is not None:
            after()

    def discard_step(self) -> None:
        """Drop the current piece (a framework's fetch that held no work)."""
        step = self.step
        self.step = None
        self._stack = []
        self._batch = None
        if step is not None and hasattr(self._timer, "release"):
            self._timer.release(step.tokens)

    def close(self) -> None:
        """The run ends: the open piece, named time between steps still open, and
        whatever the assembler holds are handed on."""
        if self.step is not None:
            self.finish_step()
        if self._between_stack:
            self.end_between(self._between_stack[0])
        self.assembler.close()

    # ------------------------------------------------------------------ phases
    def begin_between(self, name: str) -> PhaseRecord | None:
        """The user's ``phase(name)`` with no step open: named time between steps (a
        checkpoint between epochs, a save after the last step). Its record, or None
        while a step is open."""
        if self.step is not None:
            return None
        group = self._between
        if group is None:
            group = self._between = BetweenSteps()
        times = group.times
        times.append(self._clock())
        stack = self._between_stack
        up = stack[-1] if stack else None
        rec = PhaseRecord(name, up.name if up is not None else sc.MODE_BETWEEN, len(times) - 1, False, up)
        group.phases.append(rec)
        stack.append(rec)
        return rec

    def end_between(self, rec: PhaseRecord, error: BaseException | None = None) -> None:
        """End ``rec`` (and what is still open inside it); the outermost hands the
        named time on to the pipeline, in time order with the steps."""
        stack = self._between_stack
        group = self._between
        if group is None or rec not in stack:
            return
        times = group.times
        times.append(self._clock())
        end = len(times) - 1
        while stack:
            top = stack.pop()
            top.end = end
            if top is rec:
                break
        if error is not None and group.error is None and not isinstance(error, (StopIteration, GeneratorExit)):
            group.error = error
        if not stack:
            self._between = None
            self.assembler.add_between(group)

    def open_phase_start(self) -> int | None:
        """``PhaseStack.open_phase_start``; with no step open, when the innermost named
        phase between steps began."""
        start = super().open_phase_start()
        if start is None and self.step is None:
            try:
                group, stack = self._between, self._between_stack
                if group is not None and stack:
                    return group.times[stack[-1].start]
            except (AttributeError, IndexError, TypeError):
                pass
        return start

    # ---------------------------------------------------------- hook entry points
    def loader_iter_begin(self, kind: str = "torch") -> tuple:
        """``DataLoader.__iter__`` entered (or another ``kind`` of loader's iterator
        made): a new loop ends the open step (unless a manual ``step()`` drives).
        Returns the instant, ``(token, ns)``, from which the loop's first step counts
        (so worker start-up lands in its first wait)."""
        if kind not in self.loaders:
            self.loaders = self.loaders | {kind}
        token, now = self._stamp()
        step = self.step
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
                self.discard_step()
            if self.step is not None:
                self._close(token, now)  # a framework or manual driver keeps its step
        if self.on_loop is not None:
            self.on_loop()
        return token, now

    def loader_next_begin(self, iterator: Any, started_at: tuple | None = None) -> bool:
        """A DataLoader iterator's ``__next__`` was entered; True if recording."""
        if self.driver not in (DRIVER_NONE, DRIVER_DATALOADER):
            return self.begin_phase(sc.PHASE_DATALOADER_NEXT, auto=True)
        step = self.step
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
            return self.begin_phase(sc.PHASE_DATALOADER_NEXT, auto=True)
        self.driver = DRIVER_DATALOADER
        token, now = self._stamp()
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
        self._push(step, token, now)
        self._open(sc.PHASE_DATALOADER_NEXT, True, 0)
        self._learn_in -= 1
        if not self._learn_in:
            self.steady.begin()
        return True

    def loader_next_end(self, batch: Any) -> None:
        if self.step is None:
            return
        self.end_phase(sc.PHASE_DATALOADER_NEXT)
        step = self.step
        if step.batch_size is None:
            read_batch(batch, step)
        self._fetched = step
        if not self._stack:
            self._to_device_from = len(step.marks) - 1

    def loader_stopped(self, wrapped: bool = False) -> None:
        """``__next__`` raised StopIteration: a piece with only that wait is no
        step, nor part of one (no batch came of it: the time lies between steps).
        ``wrapped``: in a watched wrapper's loop (record/loop_wrappers.py), which may
        still hand out a batch fetched ahead: the piece stays for it until ``loop_ended``."""
        if self.on_loop is not None:  # what runs after a loop may call a model not seen yet
            self.on_loop()
        step = self.step
        if step is None:
            return
        if not wrapped and step.source is not None and not has_work(step) and self.driver == DRIVER_DATALOADER:
            self.discard_step()
            return
        self.end_phase(sc.PHASE_DATALOADER_NEXT)
        last = self._fetched
        if wrapped and step.batch_size is None and last is not None and last is not step:
            # The batch the loop hands out last was fetched by the piece before: its size.
            step.batch_size, step.token_count, step.token_masks = last.batch_size, last.token_count, last.token_masks

    def loop_ended(self) -> None:
        """A watched wrapper's loop ended (its generator returned): the open piece ends
        here, as at a DataLoader's end; a piece with only waits is no step."""
        step = self.step
        if step is not None and self.driver == DRIVER_DATALOADER:
            if has_work(step):
                self._close(*self._stamp())
            else:
                self.discard_step()
        if self.on_loop is not None:  # what runs after a loop may call a model not seen yet
            self.on_loop()

    def forward_begin(self, root: Any = None, loss: bool = False) -> None:
        """A root module's forward began (``root``: that module; ``loss``: it has no
        parameters, a loss module)."""
        step = self.step
        driver = self.driver
        if step is None:
            # No piece open: a loop without a DataLoader (or code after a DataLoader
            # loop ended) -- pieces are cut at forwards. Inside a manual step() loop,
            # time outside step() belongs to no step.
            if driver != DRIVER_NONE and driver != DRIVER_DATALOADER:
                self.unstepped += 1
                return
            fresh = True
        elif step.saw_forward or step.saw_backward or step.saw_optimizer:
            stack = self._stack
            top = stack[-1] if stack else None
            if top is not None and top is self._batch and root is not self._forward_root:
                last = step.phases[-1]
                if loss and last.name == _FORWARD and last.up is top and last.end == len(step.marks) - 1:
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
                and not self._optimizers
                and self._cuts(step, root)
            )
        else:
            fresh = False
        if fresh:  # a piece cut here begins with this forward
            self.start_step(DRIVER_NONE)
            step = self.step
            self._batch = self._open(_BATCH, True, 0)
            self._open(sc.PHASE_FORWARD, True, 0)
        elif self._to_device_from >= 0 and not self._stack:
            rec = PhaseRecord(sc.PHASE_TO_DEVICE, sc.SPAN_STEP, self._to_device_from, True)
            rec.end = at = self._mark()
            step.phases.append(rec)
            self._to_device_from = -1
            self._batch = self._open(_BATCH, True, at)
            self._open(sc.PHASE_FORWARD, True, at)
        elif not self.begin_phase(sc.PHASE_FORWARD, auto=True):
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
        step = self.step
        if step is not None and root is self._step_root and not self._optimizers and not self.in_backward():
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
        return root is self._step_root or root is self._last_root or self._is_train(root)

    def _is_train(self, root: Any) -> bool:
        """A forward with gradients on and its root in train mode."""
        return self._grad_enabled() and getattr(root, "training", True)

    def in_backward(self) -> bool:
        """Whether a backward pass is running: activation checkpointing recomputes its
        segments' forwards in it (and, reentrant, calls ``backward`` again), which are
        part of that backward -- no forward, root module or micro-batch of their own."""
        stack = self._stack
        return bool(stack) and stack[-1].name == _BACKWARD

    def backward_begin(self) -> bool:
        step = self.step
        if step is None:
            return False
        if self.in_backward():
            return False  # reentrant checkpointing: a backward inside the backward pass
        step.saw_backward = True
        if self._optimizers:  # inside an optimizer step: its closure
            step.closure_backward = True
        elif not step.saw_optimizer:
            step.backwards += 1
        return self.begin_phase(sc.PHASE_BACKWARD, auto=True)

    def optimizer_begin(self) -> PhaseRecord | None:
        """An optimizer step began (``Optimizer.step`` or ``GradScaler.step``): the
        record opened, or None when not recording / nested in another auto phase."""
        step = self.step
        if step is None:
            return None
        step.saw_optimizer = True
        return self._stack[-1] if self.begin_phase(sc.PHASE_OPTIMIZER_STEP, auto=True) else None

    def closure_step_begin(self) -> None:
        """``optimizer.step(closure)`` is about to run: its forward and backward run
        inside it, so an update with a closure begins a piece of its own where a
        forward would (LBFGS: one step per ``step(closure)``)."""
        if self._optimizers or self.driver not in (DRIVER_NONE, DRIVER_DATALOADER):
            return
        step = self.step
        if step is None or (
            self.driver == DRIVER_NONE
            and (step.saw_optimizer or (step.saw_forward and not step.train_forward and not step.saw_backward))
        ):
            self.start_step(DRIVER_NONE)

    def optimizer_pre(self, optimizer: Any, frame: Any = None) -> None:
        """torch's global optimizer step pre-hook; pairs with ``optimizer_post``.
        ``frame``: the frame running that ``Optimizer.step`` (the hook's caller)."""
        step = self.step
        if step is None:
            self.unstepped += 1
            return
        step.updates += 1
        if len(self._alive_optimizers) > 1:  # which ones stepped: does another join?
            ids = step.optimizers
            if ids is None:
                step.optimizers = [id(optimizer)]
            elif id(optimizer) not in ids:
                ids.append(id(optimizer))
        pending = self._optimizers
        if pending and frame is not None:
            # A step that raised never runs its post-hooks: its frame is gone from
            # the stack. Close what it left open (a nested step's frame is live).
            live = set()
            f = frame
            while f is not None:
                live.add(id(f))
                f = f.f_back
            while pending and pending[-1][2] is not None and id(pending[-1][2]) not in live:
                self.end_record(pending.pop()[1])
        pending.append((optimizer, self.optimizer_begin(), frame))

    def wrap_closure(self, optimizer: Any, closure: Callable) -> Callable:
        """``optimizer.step(closure)``: the closure's forward and backward are their
        own phases, so the optimizer phase pauses while it runs."""
        tracker = self

        def closure_with_phases(*args: Any, **kwargs: Any) -> Any:
            pending = tracker._optimizers
            index = next((i for i in range(len(pending) - 1, -1, -1) if pending[i][0] is optimizer), None)
            if index is None:
                return closure(*args, **kwargs)
            opt, rec, frame = pending[index]
            tracker.end_record(rec)
            tracker._closures += 1
            try:
                return closure(*args, **kwargs)
            finally:
                tracker._closures -= 1
                if index < len(pending) and pending[index][0] is opt:
                    pending[index] = (opt, tracker.optimizer_begin(), frame)

        return closure_with_phases

    def claim_driver(self, driver: str) -> None:
        """A framework integration drives steps from now on (DataLoader iteration no
        longer starts or ends them), even before its first step begins."""
        self.driver = driver

    def optimizer_post(self, optimizer: Any) -> None:
        """Close the phase this optimizer's pre-hook opened, if any (an optimizer that
        steps an inner one must not end the outer phase early)."""
        pending = self._optimizers
        if pending and pending[-1][0] is optimizer:  # the usual case: the innermost
            self.end_record(pending.pop()[1])
            return
        for i in range(len(pending) - 2, -1, -1):
            if pending[i][0] is optimizer:
                rec = pending[i][1]
                del pending[i:]
                self.end_record(rec)
                return
