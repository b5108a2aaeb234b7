"""When to profile: the finished steps watched for what is worth a look at its operators
(pipeline thread), and the captured steps' facts kept for the summary.

A step's *own* time is its time less its exposed communication (the ``communication``
phases, wherever they nest): in data-parallel training a rank that waits for a slow peer is slow by the
peer, and only the rank whose own work is slow is implicated. Triggers
(``OTEL_TRAINING_PROFILE``, docs/profiles.md):

- ``slow``: a train step whose own time is over ``SLOW_FACTOR`` x the rolling median
  and ``SLOW_MIN_EXCESS_S`` over it, after ``WARMUP`` train steps; the capture records
  the steps after it (the slow step itself has passed).
- ``periodic``: ``PERIODIC_REPEATS`` steps over ``PERIODIC_FACTOR`` x the median at
  equal distances: the next one is predicted, and the capture starts just before it.
- ``straggler``: with several ranks, this rank's own time over the last
  ``STRAGGLER_WINDOW`` steps stays ``STRAGGLER_FACTOR`` x above its median after
  warm-up, while its exposed communication stays under ``STRAGGLER_WAIT_SHARE`` of the
  step: the others wait on it, it waits on no one.
- ``recompile``: ``RECOMPILE_BURST`` recompilations within ``RECOMPILE_WITHIN`` train
  steps, after warm-up.

Each trigger requests at most one capture per ``interval_s``; all together at most
``max_profiles`` per process. A request goes to ``ProfileCapture`` (the training
thread runs it); nothing here calls back into the pipeline.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import NamedTuple

from otel_training import semconv as sc
from otel_training.aggregate.profile_ops import StepSpan, step_span
from otel_training.aggregate.step_record import BY_LAYOUT as _LAYOUT
from otel_training.aggregate.step_record import StepRecord
from otel_training.record.profile_capture import Capture, ProfileCapture, Request

WARMUP = 20  # train steps before any trigger means anything
MEDIAN_WINDOW = 101  # train steps in the rolling median
SLOW_FACTOR = 4.0
SLOW_MIN_EXCESS_S = 0.1  # a loaded machine stalls a healthy step by tens of milliseconds
PERIODIC_FACTOR = 3.0
PERIODIC_MIN_EXCESS_S = 0.02
PERIODIC_REPEATS = 4  # slow steps at equal distances before a period is believed
PERIODIC_MIN_GAP = 3
STRAGGLER_FACTOR = 1.5
STRAGGLER_WINDOW = 20
STRAGGLER_WAIT_SHARE = 0.1
RECOMPILE_BURST = 2
RECOMPILE_WITHIN = 50
_COMM = sc.PHASE_COMMUNICATION
_TRAIN = sc.MODE_TRAIN
_TIMES = attrgetter("times")


class StepFacts(NamedTuple):
    """A captured step, as its record says."""

    mode: str
    number: int
    own_s: float
    median_s: float | None  # the train steps' rolling median of own time then
    covered: float  # the share of the step inside the profiler's recording
    span: StepSpan


def _overlaps(start: int, end: int, windows: Sequence[tuple[int, int]]) -> bool:
    return any(start < b and end > a for a, b in windows)


class ProfileTriggers:
    """A record consumer: watches train steps, requests captures, and keeps the facts
    of the steps each capture recorded (``facts``) and the records to mark on their
    spans (``marked``, the batch just delivered)."""

    def __init__(
        self,
        capture: ProfileCapture,
        triggers: Sequence[str],
        *,
        steps: int,
        max_profiles: int,
        interval_s: float,
        world_size: Callable[[], int | None],
        recompilations: Callable[[], int],
        captures: Callable[[], Sequence[Capture]],
        read_until: Callable[[Capture], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._capture = capture
        self.triggers = frozenset(triggers)
        self._steps = steps
        self._max = max_profiles
        self._interval = interval_s
        self._world_size = world_size
        self._recompilations = recompilations
        self._captures = captures  # the captures stopped or recording (the runtime's list)
        self._read_until = read_until  # when a capture's results were read (ns; a large number until then)
        self._clock = clock
        self._ring: deque[int] = deque(maxlen=MEDIAN_WINDOW)  # recent train steps' own ns
        self._median_ns: int | None = None  # their median, as of the last batch
        self._comm: dict[int, tuple[int, ...]] = {}  # id(layout) -> positions of communication in its keys
        self._seen = 0  # train steps seen
        self._slow: deque[int] = deque(maxlen=4 * PERIODIC_REPEATS)  # numbers of recent slow-ish steps
        self._period: tuple[int, int] | None = None  # (period, a step number on it) once learned
        self._recent: deque[int] = deque(maxlen=STRAGGLER_WINDOW)  # own ns
        self._recent_comm: deque[int] = deque(maxlen=STRAGGLER_WINDOW)  # exposed communication ns
        self._baseline: int | None = None  # median own ns after warm-up (straggler's reference)
        self._recompiles_seen = 0
        self._recompile_at: deque[int] = deque(maxlen=RECOMPILE_BURST)
        self._last: dict[str, float] = {}  # trigger -> when it last requested
        self.requested = 0  # captures requested by triggers
        self.max_ratio = 0.0  # the largest own time / median seen after warm-up
        self.facts: dict[int, list[StepFacts]] = {}  # capture sequence -> its steps
        self.marked: dict[int, tuple[str, str]] = {}  # id(record) -> (file, trigger), this batch
        self._done: set[int] = set()  # captures whose steps have all come

    def add(self, records: Sequence[StepRecord]) -> None:
        self.marked = {}
        captures = self._captures()
        if captures:
            self._match(records, captures)
        if not self.triggers:
            return
        train = [r for r in records if r.mode == _TRAIN]
        if not train:
            return
        if captures:
            # A step the profiler ran in, or its results were read in (a worker thread
            # holding the GIL), is slower by the profile: no measure of the run.
            disturbed = [(c.begin_ns, self._read_until(c)) for c in captures]
            train = [r for r in train if not _overlaps(r.host[0], r.host[-1], disturbed)]
            if not train:
                return
        # Per batch, mostly in C: the pipeline's CPU is the training thread's GIL.
        owns, comms = self._owns(train)
        median = self._median_ns
        seen = self._seen
        self._seen = seen + len(owns)
        ring = self._ring
        ring.extend(owns)
        if len(ring) >= WARMUP:
            self._median_ns = sorted(ring)[len(ring) // 2]
        if median and self._seen > WARMUP:
            skip = max(0, WARMUP - seen)  # (the batch's steps still in the warm-up)
            judged = owns[skip:] if skip else owns
            if judged:
                top = max(judged)
                if top / median > self.max_ratio:
                    self.max_ratio = top / median
                if top > PERIODIC_FACTOR * median and top - median > PERIODIC_MIN_EXCESS_S * 1e9:
                    self._slow_steps(train[skip:], judged, median)
            self._straggler(owns, comms, median)
        newest = train[-1].number
        self._watch_recompiles(newest)
        self._predict(newest)

    def _owns(self, train: Sequence[StepRecord]) -> tuple[list[int], list[int] | None]:
        """Each step's own time, and its exposed communication (None: no step had any)."""
        comm = self._comm
        layouts = set(map(_LAYOUT, train))
        for layout in layouts:
            if id(layout) not in comm:  # (DDP's sync sits in backward, a closure's in the optimizer step)
                comm[id(layout)] = tuple(i for i, k in enumerate(layout.keys) if k[0] == _COMM)
        if not any(comm[id(layout)] for layout in layouts):
            return [t[-1] - t[0] for t in map(_TIMES, train)], None
        owns, comms = [], []
        for r in train:
            at = comm[id(r.layout)]
            c = sum(r.phase_ns[i] for i in at) if at else 0
            owns.append(r.step_ns - c)
            comms.append(c)
        return owns, comms

    def _slow_steps(self, train: Sequence[StepRecord], owns: Sequence[int], median: int) -> None:
        for record, own in zip(train, owns):
            if own > PERIODIC_FACTOR * median and own - median > PERIODIC_MIN_EXCESS_S * 1e9:
                on_period = self._on_period(record.number)
                self._slow_step(record.number)
                if not on_period and own > SLOW_FACTOR * median and own - median > SLOW_MIN_EXCESS_S * 1e9:
                    self._ask("slow", 0, record.number, own, median)

    # -- the triggers --------------------------------------------------------------------
    def _on_period(self, number: int) -> bool:
        period = self._period
        return period is not None and (number - period[1]) % period[0] == 0

    def _slow_step(self, number: int) -> None:
        """A slow-ish step: with the ones before it, a period? (A slow step off the
        period, a hiccup, does not hide it: any earlier ones at equal distances do.)"""
        slow = self._slow
        slow.append(number)
        if len(slow) < PERIODIC_REPEATS or self._period is not None:
            return
        seen = set(slow)
        for earlier in reversed(list(slow)[:-1]):
            gap = number - earlier
            if gap < PERIODIC_MIN_GAP or not all(number - k * gap in seen for k in range(2, PERIODIC_REPEATS)):
                continue
            # Hardly a slow step off the period in its span: a run that turned slow, or a
            # noisy machine's scattered stalls, make lattices of every spacing.
            span = number - (PERIODIC_REPEATS - 1) * gap
            if sum(1 for k in seen if span <= k <= number and (number - k) % gap) <= 1:
                self._period = (gap, number)
                return

    def _predict(self, newest: int) -> None:
        period = self._period
        if period is None or "periodic" not in self.triggers or self._capture.busy:
            return
        gap, on = period
        # The next occurrence after the newest step seen; the training thread is ahead of
        # it, and one it has passed moves the capture on by a period (profile_capture.py).
        target = on + gap * max(1, math.ceil((newest + 2 - on) / gap))
        # Start once the step before it is handed on; a late start moves on a period.
        self._ask("periodic", target - 1, target, None, self._median_ns, period=gap)

    def _straggler(self, owns: list[int], comms: list[int] | None, median: int) -> None:
        if "straggler" not in self.triggers:
            return
        world = self._world_size()
        if not world or world < 2:
            return
        if self._baseline is None:
            self._baseline = median
        recent, waits = self._recent, self._recent_comm
        recent.extend(owns)
        waits.extend(comms if comms is not None else [0] * len(owns))
        if len(recent) < STRAGGLER_WINDOW:
            return
        now = sorted(recent)[len(recent) // 2]
        total = (sum(recent) + sum(waits)) or 1
        if now > STRAGGLER_FACTOR * self._baseline and sum(waits) / total < STRAGGLER_WAIT_SHARE:
            self._ask("straggler", 0, None, now, self._baseline)

    def _watch_recompiles(self, newest: int) -> None:
        if "recompile" not in self.triggers:
            return
        count = self._recompilations()
        if count <= self._recompiles_seen:
            return
        fresh = count - self._recompiles_seen
        self._recompiles_seen = count
        if self._seen <= WARMUP:
            return
        for _ in range(min(fresh, RECOMPILE_BURST)):
            self._recompile_at.append(newest)
        at = self._recompile_at
        if len(at) >= RECOMPILE_BURST and at[-1] - at[0] <= RECOMPILE_WITHIN:
            self._ask("recompile", 0, newest, None, None)
            at.clear()

    def _ask(
        self,
        trigger: str,
        at: int,
        step: int | None,
        own: int | None,
        median: int | None,
        *,
        period: int | None = None,
    ) -> None:
        if trigger not in self.triggers or self.requested >= self._max:
            return
        now = self._clock()
        last = self._last.get(trigger)
        if last is not None and now - last < self._interval:
            return
        detail: dict = {"step": step, "own_s": None if own is None else own / 1e9}
        detail["median_s"] = None if median is None else median / 1e9
        if period is not None:
            detail["period"] = period
        if self._capture.request(Request(trigger, at, self._steps, detail, period)):
            self._last[trigger] = now
            self.requested += 1

    # -- the captured steps ----------------------------------------------------------------
    def _match(self, records: Sequence[StepRecord], captures: Sequence[Capture]) -> None:
        wanted: dict[tuple[str, int], Capture] = {}
        for capture in captures:
            if capture.sequence in self._done:
                continue
            keys = list(capture.steps)
            if capture.stop_ns and len(self.facts.get(capture.sequence, ())) >= len(keys):
                self._done.add(capture.sequence)
                continue
            for key in keys:
                wanted[key] = capture
        if not wanted:
            return
        median = self._median_ns
        for record in records:
            found = wanted.get((record.mode, record.number))
            if found is None:
                continue
            capture = found
            own = self._owns([record])[0][0]
            start, end = record.host[0], record.host[-1]
            stop = capture.stop_ns or end
            inside = max(0, min(end, stop) - max(start, capture.start_ns))
            covered = inside / (end - start) if end > start else 0.0
            fact = StepFacts(
                record.mode,
                record.number,
                own / 1e9,
                None if median is None else median / 1e9,
                covered,
                step_span(record),
            )
            self.facts.setdefault(capture.sequence, []).append(fact)
            if capture.path:
                self.marked[id(record)] = (capture.path, capture.request.trigger)
