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

Learning (repeat_learning.py): ``LEARN_AFTER`` pieces after the tracker begins (or the mode leaves), the
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
from typing import TYPE_CHECKING, Any

from otel_training.record.batches import read_batch
from otel_training.record.repeat_learning import NEXT as _NEXT
from otel_training.record.repeat_learning import Learner, RepeatHost, Template

if TYPE_CHECKING:
    pass

LEARN_AFTER = 8  # pieces before learning (0: never)
_MAX_WAIT = 1024  # pieces, at most, before learning again
_STAYED = 2  # repeated pieces that make a stay useful: learning starts again at once

_FETCHED = "loader_next_end"
_FORWARD = "forward_begin"
_BEGIN = "begin_phase"
_END = "end_phase"
_BACKWARD = "backward_begin"
_PRE = "optimizer_pre"
_POST = "optimizer_post"

_LEARNING = "learning"
_REPEATING = "repeating"


class _Learning:
    """The mode's events while it learns: each goes to the state machine, logged."""

    repeating = False

    def __init__(self, repeats: Repeats) -> None:
        self._r = repeats

    def interrupt(self) -> None:
        self._r.interrupt()

    def loader_next_begin(self, iterator: Any, started_at: Any = None) -> Any:
        r = self._r
        return r.logged(_NEXT, r.key_next(iterator, started_at), iterator, started_at)

    def loader_next_end(self, batch: Any) -> None:
        return self._r.logged(_FETCHED, (), batch)

    def forward_begin(self, root: Any = None, loss: bool = False) -> None:
        r = self._r
        return r.logged(_FORWARD, r.key_forward(root, loss), root, loss)

    def begin_phase(self, name: str, auto: bool = False) -> bool:
        return self._r.logged(_BEGIN, (name, auto), name, auto)

    def end_phase(self, name: str) -> None:
        return self._r.logged(_END, name, name)

    def backward_begin(self) -> bool:
        return self._r.logged(_BACKWARD, ())

    def optimizer_pre(self, optimizer: Any, frame: Any = None) -> None:
        r = self._r
        return r.logged(_PRE, r.key_pre(optimizer, frame), optimizer, frame)

    def optimizer_post(self, optimizer: Any) -> None:
        return self._r.logged(_POST, id(optimizer), optimizer)


class Repeats:
    """Learns a DataLoader loop's repeating piece and records repeats of it (training
    thread; ``open_phase_start`` is read from others)."""

    def __init__(self, tracker: RepeatHost) -> None:
        self._t = tracker
        self._phases = tracker.phases
        grad_enabled = tracker.grad_enabled
        alive = tracker.assembler.alive
        self.wait = LEARN_AFTER
        self.state: str | None = None  # None, learning or repeating
        self._learner = Learner(tracker)
        self._learning = _Learning(self)
        self._ended = tracker.repeated_piece_ended
        self._previous: Template | None = None  # the template of the last useful stay
        # repeating
        self.template: Template | None = None
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
        self.key_next = lambda iterator, started_at=None: (id(iterator), started_at is None)
        self.key_forward = lambda root=None, loss=False: (
            id(root),
            loss,
            grad_enabled(),
            getattr(root, "training", True),
        )
        self.key_pre = lambda optimizer, frame=None: (id(optimizer), len(alive))

    repeating = True  # (as the tracker's mode: while learning, the mode is ``_Learning``)

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
        self._learner.start(self._previous)  # a piece like the last template's repeats at once
        t.delegate(self._learning)

    def interrupt(self) -> None:
        """A call the mode does not take: a logged piece is no template; a repeated one
        is replayed through the state machine."""
        if self.state == _LEARNING:
            self._learner.spoil()
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

    # -- the events, while repeating ---------------------------------------------------------
    # Each: the template's next call? Then its mark (learning kept templates whose calls
    # add one mark at most) and its result; else the mode leaves. (Written out, not
    # shared through a helper: they run at every boundary of every repeated step.)
    def loader_next_begin(self, iterator: Any, started_at: Any = None) -> Any:
        template = self.template
        i = self.i
        if i == template.n:  # the template's end: this piece is finished, the next begins
            if started_at is not None or id(iterator) != template.source or not self._t.assembler.idle():
                return self._leave(_NEXT, iterator, started_at)
            step = self._phases.step
            now = self._clock()
            step.marks.append(now)
            self._ended(step, now, template)
            self.i = 0
            self._log.clear()
            self._pieces += 1
            self.pieces += 1
            return True
        if self._names[i] == _NEXT and self._keys_at[i] == self.key_next(iterator, started_at):
            self.i = i + 1  # a second loader's wait
            self._log.append((_NEXT, (iterator, started_at)))
            if self._adds[i]:
                self._phases.step.marks.append(self._clock())
            return self._returns[i]
        return self._leave(_NEXT, iterator, started_at)

    def loader_next_end(self, batch: Any) -> None:
        i = self.i
        if self._names[i] == _FETCHED:
            self.i = i + 1
            self._log.append((_FETCHED, (batch,)))
            step = self._phases.step
            if self._adds[i]:
                step.marks.append(self._clock())
            if step.batch_size is None:
                read_batch(batch, step)
            return None
        return self._leave(_FETCHED, batch)

    def forward_begin(self, root: Any = None, loss: bool = False) -> None:
        i = self.i
        if self._names[i] == _FORWARD and self._keys_at[i] == self.key_forward(root, loss):
            self.i = i + 1
            self._log.append((_FORWARD, (root, loss)))
            if self._adds[i]:
                self._phases.step.marks.append(self._clock())
            return None
        return self._leave(_FORWARD, root, loss)

    def begin_phase(self, name: str, auto: bool = False) -> bool:
        i = self.i
        if self._names[i] == _BEGIN and self._keys_at[i] == (name, auto):
            self.i = i + 1
            self._log.append((_BEGIN, (name, auto)))
            if self._adds[i]:
                self._phases.step.marks.append(self._clock())
            return self._returns[i]
        return self._leave(_BEGIN, name, auto)

    def end_phase(self, name: str) -> None:
        i = self.i
        if self._names[i] == _END and self._keys_at[i] == name:
            self.i = i + 1
            self._log.append((_END, (name,)))
            if self._adds[i]:
                self._phases.step.marks.append(self._clock())
            return None
        return self._leave(_END, name)

    def backward_begin(self) -> bool:
        i = self.i
        if self._names[i] == _BACKWARD:
            self.i = i + 1
            self._log.append((_BACKWARD, ()))
            if self._adds[i]:
                self._phases.step.marks.append(self._clock())
            return self._returns[i]
        return self._leave(_BACKWARD)

    def optimizer_pre(self, optimizer: Any, frame: Any = None) -> None:
        i = self.i
        if self._names[i] == _PRE and self._keys_at[i] == self.key_pre(optimizer, frame):
            self.i = i + 1
            self._log.append((_PRE, (optimizer, frame)))
            if self._adds[i]:
                self._phases.step.marks.append(self._clock())
            return None
        return self._leave(_PRE, optimizer, frame)

    def optimizer_post(self, optimizer: Any) -> None:
        i = self.i
        if self._names[i] == _POST and self._keys_at[i] == id(optimizer):
            self.i = i + 1
            self._log.append((_POST, (optimizer,)))
            if self._adds[i]:
                self._phases.step.marks.append(self._clock())
            return None
        return self._leave(_POST, optimizer)

    def _leave(self, name: str, *args: Any) -> Any:
        self._materialize()
        return getattr(self._t, name)(*args)

    # -- learning ---------------------------------------------------------------------------
    def logged(self, name: str, key: Any, *args: Any) -> Any:
        """A learning event: the state machine takes it, the learner logs it."""
        learner = self._learner
        result = learner.log(name, key, args)
        outcome = learner.outcome
        if outcome is not None:
            if isinstance(outcome, Template):
                self._enter(outcome)
            else:
                self._leave_learning()
                self._reschedule(False)
        return result

    def _leave_learning(self) -> None:
        self._learner.stop()
        self.state = None
        self._t.delegate(None)

    # -- repeating ----------------------------------------------------------------------------
    def _enter(self, template: Template) -> None:
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
