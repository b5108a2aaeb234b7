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
from typing import NamedTuple

from otel_training import semconv as sc
from otel_training.aggregate.profile_ops import StepSpan, step_span
from otel_training.aggregate.sampling import _RunningMedian
from otel_training.aggregate.step_record import StepRecord
from otel_training.record.profile_capture import Capture, ProfileCapture, Request

WARMUP = 20  # train steps before any trigger means anything
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
        self._median = _RunningMedian()
        self._comm: dict[int, tuple[int, ...]] = {}  # id(layout) -> positions of communication in its keys
        self._seen = 0  # train steps seen
        self._slow: deque[int] = deque(maxlen=4 * PERIODIC_REPEATS)  # numbers of recent slow-ish steps
        self._period: tuple[int, int] | None = None  # (period, a step number on it) once learned
        self._recent: deque[tuple[int, int]] = deque(maxlen=STRAGGLER_WINDOW)  # (own ns, comm ns)
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
        newest = -1
        # A step the profiler ran in, or its results were read in (a worker thread holding
        # the GIL), is slower by the profile: no measure of the run.
        disturbed = [(c.begin_ns, self._read_until(c)) for c in captures] if captures else None
        for record in records:
            if record.mode != sc.MODE_TRAIN:
                continue
            if disturbed and _overlaps(record.host[0], record.host[-1], disturbed):
                continue
            own, comm = self._own(record)
            median = self._median.value
            self._median.add(own)
            self._seen += 1
            newest = record.number
            if median is None or self._seen <= WARMUP or median <= 0:
                continue
            ratio = own / median
            if ratio > self.max_ratio:
                self.max_ratio = ratio
            self._straggler(own, comm, median)
            if ratio > PERIODIC_FACTOR and own - median > PERIODIC_MIN_EXCESS_S * 1e9:
                on_period = self._on_period(record.number)
                self._slow_step(record.number)
                if not on_period and ratio > SLOW_FACTOR and own - median > SLOW_MIN_EXCESS_S * 1e9:
                    self._ask("slow", 0, record.number, own, median)
        if newest >= 0:
            self._watch_recompiles(newest)
            self._predict(newest)

    # -- the triggers --------------------------------------------------------------------
    def _own(self, record: StepRecord) -> tuple[int, int]:
        layout = record.layout
        at = self._comm.get(id(layout))
        if at is None:  # (DDP's sync sits in backward, a closure's in the optimizer step, ...)
            at = self._comm[id(layout)] = tuple(i for i, k in enumerate(layout.keys) if k[0] == _COMM)
        comm = sum(record.phase_ns[i] for i in at) if at else 0
        return record.step_ns - comm, comm

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
            # The steps between are mostly not slow (a run that turned slow is slow at every gap).
            if sum(k in seen for k in range(earlier + 1, number)) <= (gap - 1) // 2:
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
        self._ask("periodic", target - 1, target, None, self._median.value, period=gap)

    def _straggler(self, own: int, comm: int, median: int) -> None:
        if "straggler" not in self.triggers:
            return
        world = self._world_size()
        if not world or world < 2:
            return
        if self._baseline is None:
            self._baseline = median
        recent = self._recent
        recent.append((own, comm))
        if len(recent) < STRAGGLER_WINDOW:
            return
        owns = sorted(o for o, _ in recent)
        now = owns[len(owns) // 2]
        waits = sum(c for _, c in recent)
        total = sum(o + c for o, c in recent) or 1
        if now > STRAGGLER_FACTOR * self._baseline and waits / total < STRAGGLER_WAIT_SHARE:
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
        median = self._median.value
        for record in records:
            found = wanted.get((record.mode, record.number))
            if found is None:
                continue
            capture = found
            own, _ = self._own(record)
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
