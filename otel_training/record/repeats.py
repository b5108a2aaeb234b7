"""Repeated pieces: a loop that repeats its last piece, recorded by its clock readings.

Most DataLoader loops repeat one piece exactly: the same hook calls in the same
order, on the same iterator, roots and optimizer, in the same grad and train modes.
The tracker's state machine then makes the same decisions and the same phase
records every step, and the pipeline drops those records as soon as they arrive (a
known layout travels as its number and its marks). ``Repeats`` is a mode the
``Tracker`` delegates its hot events to (``Tracker.mode``): it learns such a piece
and, while the next pieces repeat it, keeps only what differs from one to the next:
the clock readings, the batch's size and tokens, the memory reading. At the first
event that differs -- or any other call into the tracker -- it leaves: the tracker
replays the piece so far through its state machine with the readings already taken
(``Tracker.replay``), and recording goes on as before. The pipeline gets the
timeline the state machine would have made (tests/test_repeats.py).

Learning: ``LEARN_AFTER`` pieces after the tracker begins (or the mode leaves), the
next pieces are logged: each event, what its decisions depend on besides the
tracker's state (the iterator, the root module, grad and train modes, the
optimizer), the marks it added and what it returned. Two pieces that match, each
handed to the pipeline whole as a step of a numbered layout, make the loop a
repeating one. A loop that left after a few pieces learns again at the next one (a
piece like the last template's repeats at once); one that never repeats waits twice
as long each time.

Host clocks only: with device timing every mark carries a CUDA event, and steps
long enough to use a GPU do not feel the state machine's cost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from otel_training.record.batches import read_batch
from otel_training.record.phase_stack import PhaseStack

if TYPE_CHECKING:
    from otel_training.record.step_assembly import StepAssembler
    from otel_training.record.timeline import StepTimeline

LEARN_AFTER = 8  # pieces before learning (0: never)
_MAX_WAIT = 1024  # pieces, at most, before learning again
_STAYED = 2  # repeated pieces that make a stay useful: learning starts again at once
_TRIES = 4  # pieces logged before giving up on a loop that does not repeat

# The step fields a repeated piece takes from the template (the state machine's
# decisions); the batch's size and tokens, marks and memory are its own.
_FLAGS = (
    "saw_backward",
    "saw_optimizer",
    "saw_forward",
    "train_forward",
    "backwards",
    "closure_backward",
    "updates",
    "skipped",
    "microbatches",
)
_NEXT = "loader_next_begin"
_FETCHED = "loader_next_end"
_FORWARD = "forward_begin"
_BEGIN = "begin_phase"
_END = "end_phase"
_BACKWARD = "backward_begin"
_PRE = "optimizer_pre"
_POST = "optimizer_post"

_LEARNING = "learning"
_REPEATING = "repeating"


class RepeatHost(Protocol):
    """What the mode needs of the tracker it serves."""

    phases: PhaseStack
    assembler: StepAssembler
    thread: int | None
    _grad_enabled: Callable[[], bool]

    def direct(self, event: str, *args: Any) -> Any: ...
    def delegate(self, mode: Repeats | None) -> None: ...
    def learn_in(self, pieces: int) -> None: ...
    def use_clock(self, clock: Callable[[], int]) -> Callable[[], int]: ...
    def reset_piece(self) -> None: ...
    def replay(self, calls: list, readings: list) -> None: ...
    def repeated_piece_ended(self, step: StepTimeline, now: int) -> None: ...


class _Template:
    """One learned piece: its calls (after the DataLoader boundary that opened it),
    what it ended as, and where its open phase began after each call."""

    __slots__ = (
        "names",
        "keys",
        "adds",
        "returns",
        "open_at",
        "flags",
        "optimizers",
        "layout_id",
        "source",
        "epoch",
        "n",
    )

    def __init__(self, calls: list, open_at: list, step: StepTimeline, source: int) -> None:
        self.names = tuple(c[0] for c in calls)
        self.keys = tuple(c[1] for c in calls)
        self.adds = tuple(c[2] for c in calls)
        self.returns = tuple(c[3] for c in calls)
        self.open_at = tuple(open_at)
        self.flags = tuple(getattr(step, f) for f in _FLAGS)
        self.optimizers = tuple(step.optimizers) if step.optimizers else None
        self.layout_id = step.layout_id
        self.source = source
        self.epoch = step.epoch
        self.n = len(calls)

    def same(self, other: _Template) -> bool:
        return all(getattr(self, f) == getattr(other, f) for f in self.__slots__)


class Repeats:
    """Learns a DataLoader loop's repeating piece and records repeats of it (training
    thread; ``open_phase_start`` is read from others)."""

    def __init__(self, tracker: RepeatHost) -> None:
        self._t = tracker
        self._phases = tracker.phases
        grad_enabled = tracker._grad_enabled
        alive = tracker.assembler.alive
        self.wait = LEARN_AFTER
        self.state: str | None = None  # None, learning or repeating
        # learning
        self._calls: list = []
        self._open_at: list = []
        self._simple = True
        self._emitted = 0
        self._tries = 0
        self._last: _Template | None = None
        self._previous: _Template | None = None  # the template of the last useful stay
        self._clock_calls = 0
        self._real_clock: Callable[[], int] | None = None
        # repeating
        self.template: _Template | None = None
        self.i = 0
        self._log: list = []
        self._pieces = 0  # repeated pieces since it was entered
        self.pieces = 0  # repeated pieces in all (read by tests and benchmarks)
        self._clock: Callable[[], int] = tracker.phases.clock
        self._names: tuple = ()
        self._keys_at: tuple = ()
        self._adds: tuple = ()
        self._returns: tuple = ()
        # What each event's decisions depend on besides the tracker's state.
        self._key_next = lambda iterator, started_at=None: (id(iterator), started_at is None)
        self._key_forward = lambda root=None, loss=False: (
            id(root),
            loss,
            grad_enabled(),
            getattr(root, "training", True),
        )
        self._key_pre = lambda optimizer, frame=None: (id(optimizer), len(alive))

    @property
    def repeating(self) -> bool:
        return self.state == _REPEATING

    # -- the tracker's side ---------------------------------------------------------------
    def begin(self) -> None:
        """The tracker opened a DataLoader piece and the wait is over: log this piece."""
        t, phases = self._t, self._phases
        if (
            self.state is not None
            or not LEARN_AFTER
            or phases.timer_mark is not None
            or phases.waiting_timer is not None
            or phases.closures
            or phases.step is None
            or t.thread != threading.get_ident()
        ):
            self._reschedule(False)
            return
        self.state = _LEARNING
        self._tries = 0
        self._last = self._previous  # a piece like the last template's repeats at once
        self._start_piece()
        self._real_clock = real = phases.clock

        def counting() -> int:
            self._clock_calls += 1
            return real()

        t.use_clock(counting)
        t.delegate(self)

    def interrupt(self) -> None:
        """A call the mode does not take: a logged piece is no template; a repeated one
        is replayed through the state machine."""
        if self.state == _LEARNING:
            self._simple = False
        else:
            self.leave()

    def leave(self) -> None:
        """Hand every event back to the state machine now."""
        if self.state == _LEARNING:
            self._leave_learning()
        elif self.state == _REPEATING:
            self._materialize()

    def open_phase_start(self) -> int | None:
        """``Tracker.open_phase_start`` while repeating (any thread: reads only)."""
        try:
            template, step = self.template, self._phases.step
            at = template.open_at[self.i] if template is not None and step is not None else None
            return None if at is None else step.marks[at]
        except (AttributeError, IndexError, TypeError):
            return None

    # -- the events --------------------------------------------------------------------------
    # Each, while repeating: the template's next call? Then its mark (learning kept
    # templates whose calls add one mark at most) and its result; else the mode leaves.
    def loader_next_begin(self, iterator: Any, started_at: Any = None) -> Any:
        if self.state != _REPEATING:
            return self._logged(_NEXT, self._key_next(iterator, started_at), iterator, started_at)
        template = self.template
        i = self.i
        if i == template.n:  # the template's end: this piece is finished, the next begins
            if started_at is not None or id(iterator) != template.source or not self._t.assembler.idle():
                return self._leave(_NEXT, iterator, started_at)
            step = self._phases.step
            now = self._clock()
            step.marks.append(now)
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
            ) = template.flags
            if template.optimizers is not None:
                step.optimizers = list(template.optimizers)
            step.layout_id = template.layout_id
            self._t.repeated_piece_ended(step, now)
            self.i = 0
            self._log.clear()
            self._pieces += 1
            self.pieces += 1
            return True
        if self._names[i] == _NEXT and self._keys_at[i] == self._key_next(iterator, started_at):
            return self._took(i, _NEXT, (iterator, started_at))  # a second loader's wait
        return self._leave(_NEXT, iterator, started_at)

    def loader_next_end(self, batch: Any) -> None:
        if self.state != _REPEATING:
            return self._logged(_FETCHED, (), batch)
        i = self.i
        if self._names[i] == _FETCHED:
            self._took(i, _FETCHED, (batch,))
            step = self._phases.step
            if step.batch_size is None:
                read_batch(batch, step)
            return None
        return self._leave(_FETCHED, batch)

    def forward_begin(self, root: Any = None, loss: bool = False) -> None:
        if self.state != _REPEATING:
            return self._logged(_FORWARD, self._key_forward(root, loss), root, loss)
        i = self.i
        if self._names[i] == _FORWARD and self._keys_at[i] == self._key_forward(root, loss):
            return self._took(i, _FORWARD, (root, loss))
        return self._leave(_FORWARD, root, loss)

    def begin_phase(self, name: str, auto: bool = False) -> bool:
        if self.state != _REPEATING:
            return self._logged(_BEGIN, (name, auto), name, auto)
        i = self.i
        if self._names[i] == _BEGIN and self._keys_at[i] == (name, auto):
            return self._took(i, _BEGIN, (name, auto))
        return self._leave(_BEGIN, name, auto)

    def end_phase(self, name: str) -> None:
        if self.state != _REPEATING:
            return self._logged(_END, name, name)
        i = self.i
        if self._names[i] == _END and self._keys_at[i] == name:
            return self._took(i, _END, (name,))
        return self._leave(_END, name)

    def backward_begin(self) -> bool:
        if self.state != _REPEATING:
            return self._logged(_BACKWARD, ())
        i = self.i
        if self._names[i] == _BACKWARD:
            return self._took(i, _BACKWARD, ())
        return self._leave(_BACKWARD)

    def optimizer_pre(self, optimizer: Any, frame: Any = None) -> None:
        if self.state != _REPEATING:
            return self._logged(_PRE, self._key_pre(optimizer, frame), optimizer, frame)
        i = self.i
        if self._names[i] == _PRE and self._keys_at[i] == self._key_pre(optimizer, frame):
            return self._took(i, _PRE, (optimizer, frame))
        return self._leave(_PRE, optimizer, frame)

    def optimizer_post(self, optimizer: Any) -> None:
        if self.state != _REPEATING:
            return self._logged(_POST, id(optimizer), optimizer)
        i = self.i
        if self._names[i] == _POST and self._keys_at[i] == id(optimizer):
            return self._took(i, _POST, (optimizer,))
        return self._leave(_POST, optimizer)

    def _took(self, i: int, name: str, args: tuple) -> Any:
        """The template's call ``i`` happened again: its mark and its result."""
        self.i = i + 1
        self._log.append((name, args))
        if self._adds[i]:
            self._phases.step.marks.append(self._clock())
        return self._returns[i]

    def _leave(self, name: str, *args: Any) -> Any:
        self._materialize()
        return getattr(self._t, name)(*args)

    # -- learning ---------------------------------------------------------------------------
    def _start_piece(self) -> None:
        self._calls = []
        self._open_at = [self._open_index()]
        self._simple = True
        self._emitted = self._t.assembler.steps
        self._clock_calls = 0

    def _open_index(self) -> int | None:
        phases = self._phases
        for rec in reversed(phases.stack):
            if rec is not phases.batch and rec.end < 0:
                return rec.start
        return None

    def _logged(self, name: str, key: Any, *args: Any) -> Any:
        """The state machine takes the event; it is logged for the template."""
        step = self._phases.step
        marks = len(step.marks) if step is not None else 0
        clocks = self._clock_calls
        try:
            result = self._t.direct(name, *args)
        except BaseException:
            self._simple = False
            raise
        if self.state != _LEARNING:
            return result
        now = self._phases.step
        if name == _NEXT and step is not None and now is not step:
            self._boundary(step, key, args[0])  # the piece ended here
        elif step is None or now is not step:
            self._simple = False
        else:
            added = len(step.marks) - marks
            if added > 1 or added != self._clock_calls - clocks:
                self._simple = False  # a reading that is no mark: replay could not feed it
            self._calls.append((name, key, added, result))
            self._open_at.append(self._open_index())
        return result

    def _boundary(self, closed: StepTimeline, key: Any, iterator: Any) -> None:
        """A logged piece ended at a DataLoader boundary that opened the next one."""
        t, phases = self._t, self._phases
        step = phases.step
        template = None
        if (
            self._simple
            and key is not None
            and key[1]  # no iterator start-up handed over: the same loop
            and key[0] == closed.source
            and closed.layout_id is not None  # handed to the pipeline as a numbered layout
            and closed.error is None
            and not closed.manual
            and not closed.tokens
            and t.assembler.steps == self._emitted + 1
            and t.assembler.idle()
            and step is not None
            and step.source == key[0]
            and len(step.marks) == 1
            and phases.timer_mark is None
        ):
            template = _Template(self._calls, self._open_at, closed, key[0])
        if template is not None and self._last is not None and template.same(self._last):
            self._enter(template)
            return
        self._tries += 1
        if template is None or self._tries >= _TRIES:
            self._leave_learning()
            self._reschedule(False)
            return
        self._last = template
        self._start_piece()

    def _leave_learning(self) -> None:
        if self._real_clock is not None:
            self._t.use_clock(self._real_clock)
            self._real_clock = None
        self.state = None
        self._t.delegate(None)

    # -- repeating ----------------------------------------------------------------------------
    def _enter(self, template: _Template) -> None:
        t = self._t
        self._leave_learning()
        self.template = template
        self._names = template.names + (None,)  # past the template's end nothing matches
        self._keys_at = template.keys + (None,)
        self._adds = template.adds + (None,)
        self._returns = template.returns
        self._clock = self._phases.clock
        self.state = _REPEATING
        self.i = 0
        self._log = []
        self._pieces = 0
        t.reset_piece()  # the open piece's records are made again if the mode leaves
        t.delegate(self)

    def _materialize(self) -> None:
        """Leave: the open piece is replayed through the state machine, with the clock
        readings taken, as if it had been recorded call by call."""
        t = self._t
        if self.state != _REPEATING:
            return
        self.state = None
        t.delegate(None)
        stayed = self._pieces >= _STAYED
        self._previous = self.template if stayed else None
        self.template = None
        log = list(self._log)
        self._log.clear()
        self._reschedule(stayed)
        step = self._phases.step
        if step is None:
            return
        readings = step.marks[1:]
        t.replay(log, readings)

    def _reschedule(self, stayed: bool) -> None:
        """Learn again at the next piece after a useful stay (a loop that logs every few
        steps comes back to its template at once), else after twice the last wait."""
        self.wait = 1 if stayed else min(_MAX_WAIT, max(LEARN_AFTER, self.wait * 2))
        self._t.learn_in(self.wait if LEARN_AFTER else -1)
