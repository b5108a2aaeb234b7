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
from typing import Any, Callable, List, Optional

from otel_training import semconv as sc
from otel_training.device_timing import DeviceTimer
from otel_training.step_assembly import BOUNDARY_FORWARD, StepAssembler
from otel_training.timeline import PhaseRecord, StepTimeline

_BATCH = "batch"  # internal name of the train_batch/eval_batch container
_STEP = sc.SPAN_STEP
_FORWARD = sc.PHASE_FORWARD
_CHILDREN = frozenset(sc.BATCH_CHILDREN)

DRIVER_NONE = "none"  # no step source seen yet: implicit steps at forward
DRIVER_DATALOADER = "dataloader"
DRIVER_MANUAL = "manual"
_ITER_GAP_NS = 5_000_000  # iter(loader) this close before its first next(): one wait
_MAIN_THREAD = threading.main_thread().ident
_get_ident = threading.get_ident


class Tracker:
    """Turns hook events on the training thread into step timelines."""

    def __init__(self, sink: "Callable[[StepTimeline], None] | StepAssembler", timer: Any,
                 clock=time.perf_counter_ns):
        # The assembler groups pieces into steps; a bare callable gets one of its own.
        if not isinstance(sink, StepAssembler):
            sink = StepAssembler(sink, release=getattr(timer, "release", None))
        self.assembler = sink
        self._sink = sink.add
        self._forward_boundary = sink.boundary == BOUNDARY_FORWARD
        self._alive_optimizers = sink.alive
        self._timer = timer
        # Bound once: called at every boundary. A timer that does not override
        # mark() (host clocks only) always returns None: no tokens are kept at all.
        self._timer_mark = timer.mark if type(timer).mark is not DeviceTimer.mark else None
        if self._timer_mark is None:
            self._mark = self._mark_host
        self.after_step: Optional[Callable[[], None]] = None  # called after each piece is handed over
        self.on_loop: Optional[Callable[[], None]] = None  # called when a DataLoader loop begins
        self._clock = clock
        torch = sys.modules.get("torch")  # the manual API needs no torch
        self._grad_enabled = getattr(torch, "is_grad_enabled", None) or _grad_enabled
        self.step: Optional[StepTimeline] = None
        self._stack: List[PhaseRecord] = []
        self._batch: Optional[PhaseRecord] = None  # open container, if any
        self._batch_end = -1  # mark of the container's last child end
        self._to_device_from = -1  # mark where a pending to_device window began
        self._step_root: Any = None  # the first root module called in the step
        self._forward_root: Any = None  # the root that opened the last forward phase
        self._last_root: Any = None  # the last root called (a continuation's too)
        self._optimizers: List[tuple] = []  # (optimizer, record or None, frame) awaiting a post-hook
        self._closures = 0  # optimizer-step closures running now
        self.driver = DRIVER_NONE
        self.thread: Optional[int] = None  # the training thread's ident

    # ------------------------------------------------------------------ basics
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

    def _new_step(self, source: Any = None, epoch: Optional[int] = None) -> StepTimeline:
        step = StepTimeline(-1, epoch, source)
        self.step = step
        self._stack = []
        self._batch = None
        self._batch_end = -1
        self._to_device_from = -1
        self._step_root = None
        self._forward_root = None
        self._last_root = None
        self._optimizers = []
        return step

    # ------------------------------------------------------------------ steps
    def start_step(self, driver: str = DRIVER_MANUAL, source: Any = None, epoch: Optional[int] = None) -> None:
        """Begin a piece now, ending any open one at the same instant. The user's
        ``step()`` (``DRIVER_MANUAL``) is a step as it is; any other driver's piece
        is grouped into steps by the assembler."""
        step = self.step
        if (driver == DRIVER_MANUAL and step is not None and not step.hard
                and self.driver == DRIVER_DATALOADER and not _has_work(step)):
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

    def finish_step(self, error: Optional[BaseException] = None) -> None:
        """End the current step now (no-op without one)."""
        if self.step is None:
            return
        if error is not None:
            self.step.error = error
        self._close(*self._stamp())

    def now(self) -> int:
        """The tracker's clock (host ns)."""
        return self._clock()

    def open_phase_start(self) -> Optional[int]:
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

    def _close(self, token: Any, now: int) -> None:
        step = self.step
        self._push(step, token, now)
        end = len(step.marks) - 1
        for rec in self._stack:  # phases left open (an exception, a break)
            if rec.end < 0:
                rec.end = self._batch_end if rec is self._batch and self._batch_end >= 0 else end
        if self._batch is not None and self._batch.end < 0:
            self._batch.end = self._batch_end if self._batch_end >= 0 else end
        self.step = None
        self._stack = []
        self._batch = None
        self._optimizers = []
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
        """The run ends: the open piece and whatever the assembler holds are handed on."""
        if self.step is not None:
            self.finish_step()
        self.assembler.close()

    # ------------------------------------------------------------------ phases
    def _open(self, name: str, auto: bool, at: Optional[int] = None) -> PhaseRecord:
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
        if name in _CHILDREN:
            if top is None or top is batch:
                if batch is None:
                    rec = self._batch = self._open(_BATCH, True)
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
            end = stack.pop().end = self._mark()
        else:
            for i in range(len(stack) - 2, -1, -1):
                if stack[i].name == name:
                    break
            else:
                return
            end = self._close_down_to(i)
        if name in _CHILDREN and self._batch is not None:
            self._batch_end = end

    # ---------------------------------------------------------- hook entry points
    def loader_iter_begin(self) -> tuple:
        """``DataLoader.__iter__`` entered: a new loop ends the open step (unless a
        manual ``step()`` drives). Returns the instant, ``(token, ns)``, from which
        the loop's first step counts (so worker start-up lands in its first wait)."""
        token, now = self._stamp()
        if self.step is not None and self.driver in (DRIVER_NONE, DRIVER_DATALOADER):
            self._close(token, now)  # a framework or manual driver keeps its step
        if self.on_loop is not None:
            self.on_loop()
        return token, now

    def loader_next_begin(self, iterator: Any, started_at: Optional[tuple] = None) -> bool:
        """A DataLoader iterator's ``__next__`` was entered; True if recording."""
        if self.driver not in (DRIVER_NONE, DRIVER_DATALOADER):
            return self.begin_phase(sc.PHASE_DATALOADER_NEXT, auto=True)
        step = self.step
        # A new batch: the same loader again, or another loader once the piece holds
        # work other than a training forward still waiting for its backward. Otherwise
        # another wait of the same step: zip(loader_a, loader_b), or a second loader
        # read mid-iteration (a target-domain batch after the source forward).
        new = step is None or step.source == id(iterator) or (_has_work(step) and (
            step.source is None or step.saw_backward or step.saw_optimizer or not step.train_forward))
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
        step = self._new_step(id(iterator), getattr(iterator, "_otel_epoch", None))
        self._push(step, token, now)
        self._open(sc.PHASE_DATALOADER_NEXT, True, 0)
        return True

    def loader_next_end(self, batch: Any) -> None:
        if self.step is None:
            return
        self.end_phase(sc.PHASE_DATALOADER_NEXT)
        step = self.step
        if step.batch_size is None:
            step.batch_size = infer_batch_size(batch)
        if not self._stack:
            self._to_device_from = len(step.marks) - 1

    def loader_stopped(self) -> None:
        """``__next__`` raised StopIteration: a piece with only that wait is no
        step, nor part of one (no batch came of it: the time lies between steps)."""
        step = self.step
        if step is None:
            return
        if step.source is not None and not _has_work(step) and self.driver == DRIVER_DATALOADER:
            self.discard_step()
        else:
            self.end_phase(sc.PHASE_DATALOADER_NEXT)

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
            fresh = ((driver == DRIVER_NONE or driver == DRIVER_DATALOADER) and not self._optimizers
                     and self._cuts(step, root))
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

    def backward_begin(self) -> bool:
        step = self.step
        if step is None:
            return False
        step.saw_backward = True
        if self._optimizers:  # inside an optimizer step: its closure
            step.closure_backward = True
        elif not step.saw_optimizer:
            step.backwards += 1
        return self.begin_phase(sc.PHASE_BACKWARD, auto=True)

    def optimizer_begin(self) -> Optional[PhaseRecord]:
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
        if step is None or (self.driver == DRIVER_NONE and (
                step.saw_optimizer or (step.saw_forward and not step.train_forward and not step.saw_backward))):
            self.start_step(DRIVER_NONE)

    def optimizer_pre(self, optimizer: Any, frame: Any = None) -> None:
        """torch's global optimizer step pre-hook; pairs with ``optimizer_post``.
        ``frame``: the frame running that ``Optimizer.step`` (the hook's caller)."""
        step = self.step
        if step is None:
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

    def end_record(self, rec: Optional[PhaseRecord]) -> None:
        """Close exactly ``rec`` (and anything still open inside it)."""
        if rec is None or rec.end >= 0 or self.step is None:
            return
        stack = self._stack
        if stack and stack[-1] is rec:  # the usual case: the innermost
            end = rec.end = self._mark()
            stack.pop()
        else:
            for i in range(len(stack) - 2, -1, -1):
                if stack[i] is rec:
                    break
            else:
                return
            end = self._close_down_to(i)
        if rec.name in _CHILDREN and self._batch is not None:
            self._batch_end = end


def _has_work(step: StepTimeline) -> bool:
    phases = step.phases
    if phases and phases[-1].name != sc.PHASE_DATALOADER_NEXT:
        return True  # the usual case, at once
    for rec in phases:
        if rec.name != sc.PHASE_DATALOADER_NEXT:
            return True
    return False


_is_grad_enabled: Optional[Callable[[], bool]] = None


def _grad_enabled() -> bool:
    # torch is imported on first use, not with this module (the CLI needs no torch).
    global _is_grad_enabled
    if _is_grad_enabled is None:
        try:
            from torch import is_grad_enabled
        except Exception:  # pragma: no cover - torch missing (the manual API alone)
            return True
        _is_grad_enabled = is_grad_enabled
    return _is_grad_enabled()


def infer_batch_size(batch: Any) -> Optional[int]:
    """First dimension of the first tensor in the batch (one level deep)."""
    try:
        if isinstance(batch, (list, tuple)):  # the usual (inputs, targets): tested first
            items = batch
        elif isinstance(batch, dict):
            items = batch.values()
        else:
            shape = getattr(batch, "shape", None)
            if shape is not None:
                return int(shape[0]) if len(shape) else None
            return None
        for item in items:
            shape = getattr(item, "shape", None)
            if shape is not None and len(shape):
                return int(shape[0])
    except Exception:
        return None
    return None
