"""Learning a repeated piece: the template the repeat mode (repeats.py) plays back.

While the mode learns, every hot event goes through the ``Learner``: the tracker's
state machine takes it (``RepeatHost.direct``) and the learner logs it -- the event,
what its decisions depend on besides the tracker's state (the iterator, the root
module, grad and train modes, the optimizer), the marks it added and what it
returned. Two pieces that match, each handed to the pipeline whole as a step of a
numbered layout, make a ``Template``. Training thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from otel_training.record.phase_stack import PhaseStack

if TYPE_CHECKING:
    from otel_training.record.step_assembly import StepAssembler
    from otel_training.record.timeline import StepTimeline

_TRIES = 4  # pieces logged before giving up on a loop that does not repeat
NEXT = "loader_next_begin"  # the event that begins a DataLoader piece
GAVE_UP = "gave up"  # ``Learner.outcome`` when the loop does not repeat (else a Template)

# The step fields a repeated piece takes from the template (the state machine's
# decisions); the batch's size and tokens, marks and memory are its own.
FLAGS = (
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


class RepeatHost(Protocol):
    """What the mode needs of the tracker it serves."""

    phases: PhaseStack
    assembler: StepAssembler
    thread: int | None
    grad_enabled: Callable[[], bool]

    def direct(self, event: str, *args: Any) -> Any: ...
    def delegate(self, mode: Any) -> None: ...
    def learn_in(self, pieces: int) -> None: ...
    def use_clock(self, clock: Callable[[], int]) -> Callable[[], int]: ...
    def reset_piece(self) -> None: ...
    def replay(self, calls: list, readings: list) -> None: ...
    def repeated_piece_ended(self, step: StepTimeline, now: int, template: Template) -> None: ...


class Template:
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
        self.flags = tuple(getattr(step, f) for f in FLAGS)
        self.optimizers = tuple(step.optimizers) if step.optimizers else None
        self.layout_id = step.layout_id
        self.source = source
        self.epoch = step.epoch
        self.n = len(calls)

    def same(self, other: Template) -> bool:
        return all(getattr(self, f) == getattr(other, f) for f in self.__slots__)


class Learner:
    """Logs pieces until two match (``outcome``: the Template) or it gives up."""

    def __init__(self, host: RepeatHost) -> None:
        self._t = host
        self._phases = host.phases
        self.outcome: Template | str | None = None
        self._calls: list = []
        self._open_at: list = []
        self._simple = True
        self._emitted = 0
        self._tries = 0
        self._last: Template | None = None
        self._clock_calls = 0
        self._real_clock: Callable[[], int] | None = None

    def start(self, previous: Template | None) -> None:
        """Log from the piece open now (``previous``: a template a match repeats at once)."""
        self.outcome = None
        self._tries = 0
        self._last = previous
        self._start_piece()
        self._real_clock = real = self._phases.clock

        def counting() -> int:
            self._clock_calls += 1
            return real()

        self._t.use_clock(counting)

    def stop(self) -> None:
        """Stop logging: the tracker's clock is its own again."""
        if self._real_clock is not None:
            self._t.use_clock(self._real_clock)
            self._real_clock = None

    def spoil(self) -> None:
        """A call the learner does not log: this piece is no template."""
        self._simple = False

    def log(self, name: str, key: Any, args: tuple) -> Any:
        """The state machine takes the event; it is logged for the template."""
        step = self._phases.step
        marks = len(step.marks) if step is not None else 0
        clocks = self._clock_calls
        try:
            result = self._t.direct(name, *args)
        except BaseException:
            self._simple = False
            raise
        now = self._phases.step
        if name == NEXT and step is not None and now is not step:
            self._boundary(step, key)  # the piece ended here
        elif step is None or now is not step:
            self._simple = False
        else:
            added = len(step.marks) - marks
            if added > 1 or added != self._clock_calls - clocks:
                self._simple = False  # a reading that is no mark: replay could not feed it
            self._calls.append((name, key, added, result))
            self._open_at.append(self._open_index())
        return result

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

    def _boundary(self, closed: StepTimeline, key: Any) -> None:
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
            template = Template(self._calls, self._open_at, closed, key[0])
        if template is not None and self._last is not None and template.same(self._last):
            self.outcome = template
            return
        self._tries += 1
        if template is None or self._tries >= _TRIES:
            self.outcome = GAVE_UP
            return
        self._last = template
        self._start_piece()
