"""Steady loops: a piece that repeats the last one, recorded by its clock readings.

Most DataLoader loops repeat one piece exactly: the same hook calls in the same
order, on the same iterator, roots and optimizer, in the same grad and train modes.
The tracker's state machine then makes the same decisions and the same phase
records every step, and the pipeline's ``SentShapes`` drops those records as soon
as they arrive (a known shape travels as its number and its marks). ``Steady``
learns such a piece and, while the next pieces repeat it, keeps only what differs
from one to the next: the clock readings, the batch's size and tokens, the memory
reading. At the first call that differs -- or any other call into the tracker -- it
*materializes*: the piece so far is replayed through the state machine with the
readings already taken, and recording goes on as before. The pipeline gets the
timeline the state machine would have made (tests/test_steady.py).

Learning: ``LEARN_AFTER`` pieces after the tracker begins (or leaves steady state),
the next pieces are logged: each hook call's method, what its decisions depend on
besides the tracker's state (the iterator, the root module, grad and train modes,
the optimizer), the marks it added and what it returned. Two pieces that match, each
handed to the pipeline whole as a step of a numbered shape, make the loop steady. A
loop that left steady state after a few pieces learns again at the next one (a piece
like the last template's is steady at once); one that never repeats waits twice as
long each time.

Host clocks only: with device timing every mark carries a CUDA event, and steps
long enough to use a GPU do not feel the state machine's cost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from otel_training import semconv as sc
from otel_training.record.batches import read_batch
from otel_training.record.timeline import StepTimeline

LEARN_AFTER = 8  # pieces before learning (0: never)
_MAX_WAIT = 1024  # pieces, at most, before learning again
_STAYED = 2  # steady pieces that make a stay useful: learning starts again at once
_TRIES = 4  # pieces logged before giving up on a loop that does not repeat

# The step fields a steady piece takes from the template (the state machine's
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
_LOADER_NEXT = "loader_next_begin"
_LOADER_END = "loader_next_end"


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
        "shape_id",
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
        self.shape_id = step.shape_id
        self.source = source
        self.epoch = step.epoch
        self.n = len(calls)

    def same(self, other: _Template) -> bool:
        return all(getattr(self, f) == getattr(other, f) for f in self.__slots__)


class Steady:
    """Learns a DataLoader loop's repeating piece and records repeats of it (training
    thread; ``open_phase_start`` is read from others)."""

    def __init__(self, tracker: Any) -> None:
        self._t = tracker
        self._cls = type(tracker)
        grad_enabled = tracker._grad_enabled
        self.wait = LEARN_AFTER
        self.mode: str | None = None  # None, "learning" or "steady"
        self._installed: list[str] = []
        # learning
        self._depth = 0
        self._calls: list = []
        self._open_at: list = []
        self._simple = True
        self._emitted = 0
        self._tries = 0
        self._last: _Template | None = None
        self._previous: _Template | None = None  # the template of the last useful stay
        self._clock_calls = 0
        self._real_clock: Callable[[], int] | None = None
        # steady
        self.template: _Template | None = None
        self.i = 0
        self._log: list = []
        self._pieces = 0  # steady pieces since it was entered
        self.pieces = 0  # steady pieces in all (read by tests and benchmarks)
        self._keys: dict[str, Callable[..., Any]] = {
            _LOADER_NEXT: lambda iterator, started_at=None: (id(iterator), started_at is None),
            _LOADER_END: lambda batch: (),
            "forward_begin": lambda root=None, loss=False: (
                id(root),
                loss,
                grad_enabled(),
                getattr(root, "training", True),
            ),
            "begin_phase": lambda name, auto=False: (name, auto),  # (inlined in _events)
            "end_phase": lambda name: name,  # (inlined in _events)
            "backward_begin": lambda: (),
            "optimizer_pre": lambda optimizer, frame=None: (id(optimizer), len(tracker.assembler.alive)),
            "optimizer_post": lambda optimizer: id(optimizer),
        }
        # Every other public method changes or reads the state machine: it ends a
        # steady piece (and makes a logged one no template).
        self._others = [
            name
            for name in dir(self._cls)
            if not name.startswith("_")
            and name not in self._keys
            and name not in ("on_training_thread", "now", "open_phase_start")
            and callable(getattr(self._cls, name, None))
            and not isinstance(getattr(self._cls, name), property)
        ]

    # -- the tracker's side ---------------------------------------------------------------
    def begin(self) -> None:
        """The tracker opened a DataLoader piece and the wait is over: log this piece."""
        t = self._t
        if (
            self.mode is not None
            or not LEARN_AFTER
            or t._timer_mark is not None
            or t.waiting_timer is not None
            or t._closures
            or t.step is None
            or t.thread != threading.get_ident()
        ):
            self._reschedule(False)
            return
        self.mode = "learning"
        self._tries = 0
        self._last = self._previous  # a piece like the last template's is steady at once
        self._start_piece()
        self._real_clock = real = t._clock

        def counting() -> int:
            self._clock_calls += 1
            return real()

        t._clock = counting
        for name in self._keys:
            self._install(name, self._logged(name))
        for name in self._others:
            self._install(name, self._other_while_learning(name))

    def open_phase_start(self) -> int | None:
        """``Tracker.open_phase_start`` in steady state (any thread: reads only)."""
        try:
            template, step = self.template, self._t.step
            at = template.open_at[self.i] if template is not None and step is not None else None
            return None if at is None else step.marks[at]
        except (AttributeError, IndexError, TypeError):
            return None

    # -- learning ---------------------------------------------------------------------------
    def _start_piece(self) -> None:
        t = self._t
        self._calls = []
        self._open_at = [self._open_index()]
        self._simple = True
        self._emitted = t.assembler.steps
        self._clock_calls = 0

    def _open_index(self) -> int | None:
        t = self._t
        for rec in reversed(t._stack):
            if rec is not t._batch and rec.end < 0:
                return rec.start
        return None

    def _logged(self, name: str) -> Callable:
        t, method, key_of = self._t, getattr(self._cls, name), self._keys[name]

        def logged(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # the tracker calling itself
                return method(t, *args, **kwargs)
            step = t.step
            try:
                key = key_of(*args, **kwargs)
            except Exception:
                key, self._simple = None, False
            marks = len(step.marks) if step is not None else 0
            clocks = self._clock_calls
            self._depth += 1
            try:
                result = method(t, *args, **kwargs)
            except BaseException:
                self._simple = False
                raise
            finally:
                self._depth -= 1
            if self.mode != "learning":
                return result
            if name == _LOADER_NEXT and step is not None and t.step is not step:
                self._boundary(step, key, args[0])  # the piece ended here
            elif step is None or t.step is not step:
                self._simple = False
            else:
                added = len(step.marks) - marks
                if added > 1 or added != self._clock_calls - clocks:
                    self._simple = False  # a reading that is no mark: replay could not feed it
                self._calls.append((name, key, added, result))
                self._open_at.append(self._open_index())
            return result

        return logged

    def _other_while_learning(self, name: str) -> Callable:
        t, method = self._t, getattr(self._cls, name)

        def other(*args: Any, **kwargs: Any) -> Any:
            if not self._depth:
                self._simple = False
            self._depth += 1
            try:
                return method(t, *args, **kwargs)
            finally:
                self._depth -= 1

        return other

    def _boundary(self, closed: StepTimeline, key: Any, iterator: Any) -> None:
        """A logged piece ended at a DataLoader boundary that opened the next one."""
        t = self._t
        template = None
        if (
            self._simple
            and key is not None
            and key[1]  # no iterator start-up handed over: the same loop
            and key[0] == closed.source
            and closed.shape_id is not None  # handed to the pipeline as a numbered shape
            and closed.error is None
            and not closed.hard
            and not closed.tokens
            and t.assembler.steps == self._emitted + 1
            and t.assembler.idle()
            and t.step is not None
            and t.step.source == key[0]
            and len(t.step.marks) == 1
            and t._timer_mark is None
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
        self._uninstall()
        if self._real_clock is not None:
            self._t._clock = self._real_clock
            self._real_clock = None
        self.mode = None

    # -- steady ------------------------------------------------------------------------------
    def _enter(self, template: _Template) -> None:
        t = self._t
        self._leave_learning()
        self.template = template
        self.mode = "steady"
        self.i = 0
        self._log = []
        self._pieces = 0
        step = t.step
        step.phases.clear()  # the open piece's records are re-made if it materializes
        t._stack = []
        t._batch = None
        install = self._install
        events = self._events(template)
        events[_LOADER_NEXT] = self._next_begin(template, events[_LOADER_NEXT])
        for name, fn in events.items():
            install(name, fn)
        for name in self._others:
            install(name, self._other_while_steady(name))
        install("open_phase_start", self.open_phase_start)

    def _events(self, template: _Template) -> dict[str, Callable]:
        """A steady piece's hook calls, one function each (the tracker's signatures: no
        argument packing on the hot path): the template's next call, or the end of
        steady state."""
        t, cls, k = self._t, self._cls, self._keys
        pad = (None,)  # past the template's end nothing matches
        names, keys, adds, returns = template.names + pad, template.keys + pad, template.adds + pad, template.returns
        clock, log = t._clock, self._log
        read = read_batch

        def leave(name: str, *args: Any) -> Any:
            self.materialize()
            return getattr(cls, name)(t, *args)

        # Each: the template's next call? Then its mark (learning kept templates whose
        # calls add one mark at most) and its result; else the state machine takes over.
        key_next, key_fwd = k[_LOADER_NEXT], k["forward_begin"]
        key_pre, key_post = k["optimizer_pre"], k["optimizer_post"]

        def loader_next_begin(iterator: Any, started_at: Any = None) -> Any:
            i = self.i
            if names[i] == _LOADER_NEXT and keys[i] == key_next(iterator, started_at):
                self.i = i + 1
                log.append((_LOADER_NEXT, (iterator, started_at)))
                if adds[i]:
                    t.step.marks.append(clock())
                return returns[i]
            return leave(_LOADER_NEXT, iterator, started_at)

        def loader_next_end(batch: Any) -> Any:
            i = self.i
            if names[i] == _LOADER_END:
                self.i = i + 1
                log.append((_LOADER_END, (batch,)))
                step = t.step
                if adds[i]:
                    step.marks.append(clock())
                if step.batch_size is None:
                    read(batch, step)
                t._fetched = step
                return None
            return leave(_LOADER_END, batch)

        def forward_begin(root: Any = None, loss: bool = False) -> Any:
            i = self.i
            if names[i] == "forward_begin" and keys[i] == key_fwd(root, loss):
                self.i = i + 1
                log.append(("forward_begin", (root, loss)))
                if adds[i]:
                    t.step.marks.append(clock())
                return None
            return leave("forward_begin", root, loss)

        def begin_phase(name: str, auto: bool = False) -> Any:
            i = self.i
            if names[i] == "begin_phase" and keys[i] == (name, auto):
                self.i = i + 1
                log.append(("begin_phase", (name, auto)))
                if adds[i]:
                    t.step.marks.append(clock())
                return returns[i]
            return leave("begin_phase", name, auto)

        def end_phase(name: str) -> Any:
            i = self.i
            if names[i] == "end_phase" and keys[i] == name:
                self.i = i + 1
                log.append(("end_phase", (name,)))
                if adds[i]:
                    t.step.marks.append(clock())
                return None
            return leave("end_phase", name)

        def backward_begin() -> Any:
            i = self.i
            if names[i] == "backward_begin":
                self.i = i + 1
                log.append(("backward_begin", ()))
                if adds[i]:
                    t.step.marks.append(clock())
                return returns[i]
            return leave("backward_begin")

        def optimizer_pre(optimizer: Any, frame: Any = None) -> Any:
            i = self.i
            if names[i] == "optimizer_pre" and keys[i] == key_pre(optimizer, frame):
                self.i = i + 1
                log.append(("optimizer_pre", (optimizer, frame)))
                if adds[i]:
                    t.step.marks.append(clock())
                return None
            return leave("optimizer_pre", optimizer, frame)

        def optimizer_post(optimizer: Any) -> Any:
            i = self.i
            if names[i] == "optimizer_post" and keys[i] == key_post(optimizer):
                self.i = i + 1
                log.append(("optimizer_post", (optimizer,)))
                if adds[i]:
                    t.step.marks.append(clock())
                return None
            return leave("optimizer_post", optimizer)

        return {
            _LOADER_NEXT: loader_next_begin,
            _LOADER_END: loader_next_end,
            "forward_begin": forward_begin,
            "begin_phase": begin_phase,
            "end_phase": end_phase,
            "backward_begin": backward_begin,
            "optimizer_pre": optimizer_pre,
            "optimizer_post": optimizer_post,
        }

    def _next_begin(self, template: _Template, generic: Callable) -> Callable:
        """``loader_next_begin`` in steady state: at the template's end, the piece is
        finished from the template and the next one begins."""
        t, method = self._t, getattr(self._cls, _LOADER_NEXT)
        n, source, epoch, shape_id = template.n, template.source, template.epoch, template.shape_id
        flags, optimizers = template.flags, template.optimizers
        clock, sink, assembler, log = t._clock, t._sink, t.assembler, self._log

        def next_begin(iterator: Any, started_at: Any = None) -> bool:
            if self.i != n:
                return generic(iterator, started_at)  # a second loader's wait inside the piece
            if started_at is not None or id(iterator) != source or not assembler.idle():
                self.materialize()
                return method(t, iterator, started_at)
            step = t.step
            now = clock()
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
            ) = flags
            if optimizers is not None:
                step.optimizers = list(optimizers)
            step.shape_id = shape_id
            t.step = None
            memory = t.memory
            if memory is not None and now >= memory.due:
                step.memory = memory.read(now)
            sink(step)
            after = t.after_step
            if after is not None:
                after()
            new = StepTimeline(-1, epoch, source)
            new.marks.append(now)
            t.step = new
            self.i = 0
            log.clear()
            self._pieces += 1
            self.pieces += 1
            return True

        return next_begin

    def _other_while_steady(self, name: str) -> Callable:
        t, method = self._t, getattr(self._cls, name)

        def other(*args: Any, **kwargs: Any) -> Any:
            self.materialize()
            return method(t, *args, **kwargs)

        return other

    def materialize(self) -> None:
        """Leave steady state: the open piece is replayed through the state machine,
        with the clock readings taken, as if it had been recorded call by call."""
        t = self._t
        if self.mode != "steady":
            return
        self._uninstall()
        self.mode = None
        stayed = self._pieces >= _STAYED
        self._previous = self.template if stayed else None
        self.template = None
        log = list(self._log)
        self._log.clear()
        self._reschedule(stayed)
        step = t.step
        if step is None:
            return
        marks = step.marks
        readings = marks[1:]
        del marks[1:]
        step.batch_size = step.token_count = step.token_masks = None  # read again by the replay
        t._reset_piece_state()
        t._open(sc.PHASE_DATALOADER_NEXT, True, 0)
        real = t._clock
        t._clock = iter(readings).__next__
        try:
            cls = self._cls
            for name, args in log:
                getattr(cls, name)(t, *args)
        finally:
            t._clock = real

    # -- helpers ------------------------------------------------------------------------------
    def _reschedule(self, stayed: bool) -> None:
        """Learn again at the next piece after a useful stay (a loop that logs every few
        steps comes back to its template at once), else after twice the last wait."""
        self.wait = 1 if stayed else min(_MAX_WAIT, max(LEARN_AFTER, self.wait * 2))
        self._t._learn_in = self.wait if LEARN_AFTER else -1

    def _install(self, name: str, fn: Callable) -> None:
        setattr(self._t, name, fn)
        self._installed.append(name)

    def _uninstall(self) -> None:
        state = self._t.__dict__
        for name in self._installed:
            state.pop(name, None)
        self._installed = []
