"""One finished step, resolved once: the immutable ``StepRecord`` every consumer reads.

``Resolver.resolve`` turns a ``StepTimeline`` (what the training thread recorded)
into a ``StepRecord``: device times resolved and marks GPU-synchronized, the mode,
each phase's duration, the untracked rest, GPU idle time per phase, the trace
sampling decision. Consumers (run summary, coverage, spans, metrics) take records,
or batches of them, and never write back. Pipeline thread only.

Steps of a loop mostly share one *layout*: the same phases, nested the same way,
starting and ending at the same mark indices. A ``Layout`` is made once per layout
and shared by its records; it computes a step's phase durations with a few
C-level calls, and consumers group records by it to add phase columns in bulk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter, sub
from typing import TYPE_CHECKING, NamedTuple

from otel_training import semconv as sc
from otel_training.aggregate.idle import idle_between, synchronized_marks
from otel_training.aggregate.sampling import TailCapture
from otel_training.record.batches import mask_tokens
from otel_training.record.timeline import PhaseRecord, StepTimeline
from otel_training.timing.device import DeviceTimer

if TYPE_CHECKING:
    from otel_training.record.flops import FlopCount
    from otel_training.record.memory import MemoryReading

UNTRACKED_KEY = (sc.PHASE_UNTRACKED, sc.SPAN_STEP)  # the (name, parent) of untracked time
# Field getters for consumers' batch loops: ``map(PHASE_NS, run)`` runs in C.
BY_LAYOUT = attrgetter("layout")
PHASE_NS = attrgetter("phase_ns")
UNTRACKED_NS = attrgetter("untracked_ns")
BATCH_SIZE = attrgetter("batch_size")
MICROBATCHES = attrgetter("microbatches")
SKIPPED = attrgetter("skipped")
IDLE_NS = attrgetter("idle_ns")
TOKENS = attrgetter("tokens")
_TIMES = attrgetter("times")
_FIRST, _LAST = itemgetter(0), itemgetter(-1)
_LAYOUT_KEY = attrgetter("name", "parent_name", "start", "end")
_new_tuple = tuple.__new__
_MAX_LAYOUTS = 256  # per mode; beyond, layouts are made per step and not remembered
PhaseKey = tuple[str, str]  # (name, parent)


class LayoutPhase(NamedTuple):
    """One closed phase of a layout: its name (``batch`` resolved to train_batch or
    eval_batch), its key, its marks, and the position of its parent phase (-1: the
    step itself)."""

    name: str
    key: PhaseKey
    start: int
    end: int
    parent: int


def _getter(indices: Sequence[int]) -> Callable[[Sequence[int]], tuple]:
    """``itemgetter(*indices)`` that always returns a tuple."""
    if not indices:
        return lambda values: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda values: (values[i],)
    return itemgetter(*indices)


class Layout:
    """The phases of one step layout, and how to get their durations from marks."""

    __slots__ = ("mode", "phases", "keys", "top", "_starts", "_ends", "_top", "_fold")

    def __init__(self, mode: str, records: Sequence[PhaseRecord]) -> None:
        batch = sc.PHASE_TRAIN_BATCH if mode == sc.MODE_TRAIN else sc.PHASE_EVAL_BATCH
        self.mode = mode
        closed = [rec for rec in records if rec.end >= 0]
        position = {id(rec): i for i, rec in enumerate(closed)}
        phases = []
        for rec in closed:
            name = batch if rec.name == "batch" else rec.name
            parent = batch if rec.parent_name == "batch" else rec.parent_name
            up = position.get(id(rec.outer), -1) if rec.outer is not None else -1
            phases.append(LayoutPhase(name, (name, parent), rec.start, rec.end, up))
        self.phases: tuple[LayoutPhase, ...] = tuple(phases)
        # Keys in first-seen order; a key seen several times (accumulation: a forward
        # per micro-batch) sums its phases.
        order: dict[PhaseKey, list[int]] = {}
        for i, p in enumerate(phases):
            order.setdefault(p.key, []).append(i)
        self.keys: tuple[PhaseKey, ...] = tuple(order)
        flat = [i for positions in order.values() for i in positions]
        self._starts = _getter([phases[i].start for i in flat])
        self._ends = _getter([phases[i].end for i in flat])
        self._fold: list[tuple[int, int]] | None = None
        if len(flat) != len(order):
            bounds: list[tuple[int, int]] = []
            first = 0
            for positions in order.values():
                bounds.append((first, first + len(positions)))
                first += len(positions)
            self._fold = bounds
        self.top: tuple[int, ...] = tuple(i for i, rec in enumerate(closed) if rec.outer is None)
        at = {i: j for j, i in enumerate(flat)}
        self._top = _getter([at[i] for i in self.top])

    def durations(self, times: Sequence[int]) -> tuple[tuple[int, ...], int]:
        """(per key, its nanoseconds; the top-level phases' sum) for these marks."""
        flat = tuple(map(sub, self._ends(times), self._starts(times)))
        covered = sum(self._top(flat))
        fold = self._fold
        if fold is None:
            return flat, covered
        return tuple(sum(flat[a:b]) for a, b in fold), covered


class StepRecord(NamedTuple):
    """A finished step, resolved. Times are ``perf_counter_ns`` (``Resolver.offset``
    maps them to epoch ns); ``times`` are GPU-synchronized when the device is
    observed, else the host marks."""

    number: int  # ``training.step``: train steps before a train step; eval steps before an eval step
    epoch: int | None
    mode: str
    layout: Layout
    phase_ns: tuple[int, ...]  # per ``layout.keys``
    untracked_ns: int
    times: tuple[int, ...]
    host: tuple[int, ...]
    device: tuple[int | None, ...] | None
    idle_ns: dict[str, int] | None  # GPU idle per top-level phase name (and untracked)
    idle_by_phase: dict[int, int] | None  # per ``layout.phases`` position
    batch_size: int | None
    microbatches: int  # training steps: backward passes (at least 1); eval: 0
    skipped: int  # GradScaler steps that skipped their update
    error: BaseException | None
    trace_reason: str | None  # why it is traced (first, error, slow, sampled), or None
    timing: str  # ``off`` (host clocks), ``events`` or ``sync``
    tokens: int | None = None  # token ids in the step's batches (padding left out)
    flops: FlopCount | None = None  # the run's count, on training steps once known
    memory: MemoryReading | None = None  # at the step's end, when one was taken
    train_before: int = 0  # train steps before this step (a train step's ``number``)

    @property
    def step_ns(self) -> int:
        return self.times[-1] - self.times[0]


def bounds(records: Sequence[StepRecord]) -> tuple[list[int], list[int]]:
    """The records' start and end times (``times[0]``, ``times[-1]``)."""
    times = list(map(_TIMES, records))
    return list(map(_FIRST, times)), list(map(_LAST, times))


class SentLayouts:
    """Numbers for the step layouts handed to the pipeline (training thread, at ``submit``).

    A step's layout is its phases' names, parents and marks. Each new layout gets a
    number, and its first step keeps its phase records so the resolver can make the
    layout; a later step of the same layout carries only the number and gives its
    records up before it is queued. Why: a queued step's objects live until the
    pipeline drains (500 ms), long enough for the collector to promote them, and six
    phase records a step, promoted, brought a full collection of the whole process
    every ~20 000 steps (docs/performance.md). Freed here, at once, they never are.
    The same steps reach the resolver in the same order, so a numbered layout's
    is made before any step that carries only its number.
    """

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: dict[bool, dict[tuple, int]] = {True: {}, False: {}}

    def shed(self, step: StepTimeline) -> None:
        phases = step.phases
        marks = step.marks
        if len(marks) < 2:
            return  # the resolver skips such a step: it makes no layout
        # A queued step is only read from now on: it sheds what the collector would track.
        if step.layout_id is not None:  # a repeated piece (record/repeats.py): its number, no records
            step.shed(step.layout_id, True)
            return
        ids = self._ids[step.saw_backward or step.saw_optimizer]
        key = tuple(map(_LAYOUT_KEY, phases))
        number = ids.get(key)
        if number is not None:
            step.shed(number, True)
        elif len(ids) < _MAX_LAYOUTS:
            number = ids[key] = len(ids)
            step.shed(number, False)
        else:
            step.shed(None, False)


class Resolver:
    """Timelines in, records out (pipeline thread)."""

    def __init__(self, timer: DeviceTimer, capture: TailCapture) -> None:
        self._timer = timer
        self._capture = capture
        self._layouts: dict[str, dict[int | tuple, Layout | None]] = {}  # by layout number or phase keys
        self.flops: FlopCount | None = None  # from the step that carried it on

    def layout(self, mode: str, phases: Sequence[PhaseRecord], layout_id: int | None = None) -> Layout:
        """The layout of a step of these phases; ``layout_id``: its layout's number from
        ``SentLayouts`` (a step of a number seen before comes without phases)."""
        layouts = self._layouts.get(mode)
        if layouts is None:
            layouts = self._layouts[mode] = {}
        key: int | tuple = layout_id if layout_id is not None else tuple(map(_LAYOUT_KEY, phases))
        layout = layouts.get(key)
        if layout is not None:
            return layout
        if key in layouts:
            raise LookupError("the layout of this step's layout could not be made")
        # Numbered layouts are always kept (SentLayouts numbers _MAX_LAYOUTS at most):
        # their later steps come without phases.
        cache = layout_id is not None or len(layouts) < _MAX_LAYOUTS
        if cache:
            layouts[key] = None  # if making it fails (our bug), the layout's later steps fail too
        layout = Layout(mode, phases)
        if cache:
            layouts[key] = layout
        return layout

    def resolve(self, step: StepTimeline) -> StepRecord | None:
        host = step.marks
        if len(host) < 2:
            return None
        train = step.saw_backward or step.saw_optimizer
        mode = sc.MODE_TRAIN if train else sc.MODE_EVAL
        # First: a step that brought a new layout must leave its layout whatever fails after.
        layout = self.layout(mode, step.phases, step.layout_id)
        timer = self._timer
        device = timer.resolve(host, step.tokens) if timer.observes_device else None
        host_marks = tuple(host)
        times = tuple(synchronized_marks(host, device)) if device is not None else host_marks
        flops = None
        micro = 0
        if train:
            micro = step.microbatches or (step.backwards + step.closure_backward) or 1
            if step.flops is not None:
                self.flops = step.flops
            flops = self.flops
        tokens = step.token_count
        if step.token_masks:
            masked = mask_tokens(step.token_masks)
            tokens = None if masked is None else (tokens or 0) + masked
        phase_ns, covered = layout.durations(times)
        step_ns = times[-1] - times[0]
        idle_ns = idle_by_phase = None
        timing = "off"
        if device is not None:
            idle_ns, idle_by_phase = _attribute_idle(layout, host, device)
            timing = timer.mode  # the events timer switches on lazily, when CUDA is used
        reason = self._capture.decide(mode, step_ns, host[-1], step.error is not None)
        # tuple.__new__: the named tuple's own __new__ is a Python function (a third of
        # the cost of making a record, the pipeline's largest per-step share).
        return _new_tuple(
            StepRecord,
            (
                step.index,
                step.epoch,
                mode,
                layout,
                phase_ns,
                step_ns - covered,
                times,
                host_marks,  # (the same tuple as ``times`` on host clocks)
                tuple(device) if device is not None else None,
                idle_ns,
                idle_by_phase,
                step.batch_size,
                micro,
                step.skipped,
                step.error,
                reason,
                timing,
                tokens,
                flops,
                step.memory,
                step.train_before,
            ),
        )


def _attribute_idle(layout: Layout, host: Sequence[int], device: Sequence[int | None]) -> tuple:
    """GPU idle per top-level phase name (and per untracked gap), and per phase."""
    idle: dict[str, int] = {}
    by_phase: dict[int, int] = {}
    prev_end = 0
    top = sorted((layout.phases[i].start, layout.phases[i].end, i) for i in layout.top)
    for start, end, i in top:
        if start > prev_end:  # an untracked gap
            gap = idle_between(host, device, prev_end, start)
            if gap:
                idle[sc.PHASE_UNTRACKED] = idle.get(sc.PHASE_UNTRACKED, 0) + gap
        ns = idle_between(host, device, start, end)
        by_phase[i] = ns
        if ns:
            name = layout.phases[i].name
            idle[name] = idle.get(name, 0) + ns
        prev_end = max(prev_end, end)
    last = len(host) - 1
    if last > prev_end:
        gap = idle_between(host, device, prev_end, last)
        if gap:
            idle[sc.PHASE_UNTRACKED] = idle.get(sc.PHASE_UNTRACKED, 0) + gap
    return idle, by_phase
