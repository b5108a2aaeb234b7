"""The whole process's wall time, every second in one activity, and goodput.

``JobClock`` is a pipeline consumer: steps (``StepRecord``) and named time between
steps (``BetweenRecord``) arrive in time order, and the training thread's
checkpoint and compile intervals (record/activities.py) are read from its
``ActivityLog``. The time from the process's start to its exit is split into:

- ``startup``: process start to the first step (imports, model build, data set-up);
- ``compile``: ``torch.compile`` compilations (torch's own compile events), wherever
  they fall -- most inside the first steps, recompilations inside the step they hit;
- ``train``, ``eval``: train and eval steps, less the compile and checkpoint time in them;
- ``checkpoint``: checkpoint saves and loads, inside steps or between them;
- the user's ``phase(name)`` with no step open, by name (less what the two above took);
- ``other``: the rest between the first step and the last;
- ``shutdown``: after the last step to exit (less named, checkpoint and compile time).

Goodput is ``train`` over the wall time. The ideal step time is
ml-goodput-measurement's robust center: the mean of the train step times at most
the median plus 3 median absolute deviations; time lost to slower steps (less the
compile time inside train steps, which is ``compile``) is the slow-step badput.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from operator import attrgetter, itemgetter, ne
from typing import Any

from otel_training import semconv as sc
from otel_training.aggregate.ideal_step import slow_steps
from otel_training.aggregate.run_sections import Checkpoint, CheckpointCall, Compile, Job, Recompiled
from otel_training.record.activities import CHECKPOINT, COMPILE, LOAD, RECOMPILE, SAVE, UNKNOWN, ActivityLog

STARTUP, TRAIN, EVAL, OTHER, SHUTDOWN = "startup", sc.MODE_TRAIN, sc.MODE_EVAL, "other", "shutdown"
BUILTIN = (STARTUP, COMPILE, TRAIN, EVAL, CHECKPOINT, OTHER, SHUTDOWN)
_PENDING = "_pending"  # time after the last step so far: other if a step follows, else shutdown
_RECENT = 1024  # pieces of unnamed time a named phase that held steps can still claim
_MAX_NAMES = 16  # user names kept as activities of their own (the rest: "(named)")
_MAX_RECOMPILED = 20  # steps listed with the recompilations they hit
_MAX_SAVES = 64  # saves kept with their global step (a resume goes back to one of the last)
_HOST, _MODE = attrgetter("host"), attrgetter("mode")
_FIRST, _LAST = itemgetter(0), itemgetter(-1)


class JobClock:
    """The process's wall time by activity. ``add``/``add_between`` run on the pipeline
    thread; ``end``, ``finish``, ``totals`` and ``to_dict`` may run on any (all under
    ``_lock``)."""

    def __init__(self, started_ns: int, log: ActivityLog, source: str = "proc") -> None:
        self.started = started_ns
        self.source = source  # where the start time came from ("proc", "psutil", "instrumentation")
        self.log = log
        self._ns: dict[str, int] = {}  # activity -> ns, final (but for claims by a named phase)
        self._cursor = started_ns  # time accounted up to
        self._first: int | None = None  # the first step's start
        self._recent: deque[list] = deque(maxlen=_RECENT)  # [start, end, activity] of unnamed pieces
        self._between_activity = 0  # checkpoint/compile ns between steps (after the first)
        self._ckpt: dict[str, list] = {}  # label -> [count, ns]
        self._ckpt_ops = {SAVE: [0, 0], LOAD: [0, 0]}
        self._compiles = 0
        self.recompilations = 0  # so far (the profile triggers read it, after this consumer)
        self._compile_ops_known = True
        self._first_compile_step: tuple[str, int] | None = None
        self._compile_steps: dict[tuple[str, int], list] = {}  # (mode, step) -> [compilations, ns]
        self._compile_in_train = 0  # compile ns inside train steps (kept out of the slow-step badput)
        self._saves: deque[list] = deque(maxlen=_MAX_SAVES)  # [global step, train ns by then] of tagged saves
        self._unmarked = False  # a save's train ns is taken once the step holding it is in
        self.restart_s = 0.0  # the gap before this attempt of a restarted run (runtime/attempts.py)
        self._end: int | None = None
        self._finished = False
        self._lock = threading.Lock()

    # -- pipeline thread ---------------------------------------------------------------
    def add(self, records: Sequence) -> None:
        """A batch of finished steps, in time order. The intervals inside them are in the
        log already: each was added before the step that holds it was handed on."""
        with self._lock:
            if self._finished:
                return
            items = self.log.items
            nxt = items[0].start if items else -1
            ns = self._ns
            if self._contiguous(records, nxt):
                return
            for r in records:  # (one step: the usual case is two comparisons and an addition)
                host = r.host
                start, end = host[0], host[-1]
                cursor = self._cursor
                if start > cursor or self._first is None or _PENDING in ns:
                    if start > cursor:
                        self._unnamed(cursor, start)
                        cursor = start
                    if self._first is None:
                        self._first = start
                    else:
                        self._settle(OTHER)  # a step follows the time after the last one
                    nxt = items[0].start if items else -1
                if end > cursor:
                    if nxt < 0 or end <= nxt:
                        mode = r.mode
                        ns[mode] = ns.get(mode, 0) + end - cursor
                    else:
                        self._carve(cursor, end, r.mode, step=r)
                        nxt = items[0].start if items else -1
                    self._cursor = end
                else:
                    self._cursor = cursor

    def _contiguous(self, records: Sequence, nxt: int) -> bool:
        """The usual batch, added at C speed: steps of one mode, each beginning where
        the one before ended (the first where the last batch's did), no interval in
        them. False (nothing added) for any other."""
        if self._first is None or not records or _PENDING in self._ns:
            return False
        hosts = list(map(_HOST, records))
        starts, ends = list(map(_FIRST, hosts)), list(map(_LAST, hosts))
        end = ends[-1]
        if starts[0] != self._cursor or (0 <= nxt < end) or any(map(ne, starts[1:], ends)):
            return False
        modes = set(map(_MODE, records))
        if len(modes) != 1:
            return False
        (mode,) = modes
        self._ns[mode] = self._ns.get(mode, 0) + end - starts[0]
        self._cursor = end
        return True

    def add_between(self, record: Any) -> None:
        """Named time between steps (the outermost phase), after the steps that began
        before it."""
        with self._lock:
            if self._finished:
                return
            name = self._name(record.name)
            start, end = record.start, record.end
            cursor = self._cursor
            if start < cursor:  # steps ran inside it: the unnamed time between them is its
                self._claim(start, min(end, cursor), name)
            if end > cursor:
                if start > cursor:
                    self._unnamed(cursor, start)
                    cursor = start
                self._carve(cursor, end, name)
                self._cursor = end

    # -- any thread --------------------------------------------------------------------
    def end(self, ns: int | None = None) -> None:
        """The process is exiting now (its main code returned, or shutdown began): the
        first call wins."""
        with self._lock:
            if self._end is None:
                self._end = time.perf_counter_ns() if ns is None else ns

    def finish(self) -> None:
        """All steps are in (the pipeline stopped): the time after the last step to the
        end is shut-down, less what named phases and activities took."""
        with self._lock:
            if self._finished:
                return
            if self._end is None:
                self._end = time.perf_counter_ns()
            # A step still open when the program's code returned ends after that instant.
            end = self._end = max(self._end, self._cursor)
            between = self._between_activity  # (the self-check looks inside the loop only)
            if end > self._cursor:
                self._unnamed(self._cursor, end)
                self._cursor = end
            self._take(end)
            self._between_activity = between  # intervals after the cursor (never in a range): counted as they are
            self._settle(SHUTDOWN if self._first is not None else STARTUP)
            self._finished = True

    def totals(self) -> dict[str, float]:
        """Seconds by activity accounted so far (final for the time before the last
        step delivered; shut-down only once finished)."""
        with self._lock:
            return {k: v / 1e9 for k, v in self._ns.items() if k != _PENDING}

    def between_activity_ns(self) -> int:
        """Checkpoint and compile time between steps (after the first): accounted for,
        though outside steps (the self-check does not count it)."""
        with self._lock:
            return self._between_activity

    def saves(self) -> list[tuple[int, float]]:
        """(global step, train seconds by then) of the saves that knew their global
        step, oldest first."""
        with self._lock:
            train = self._ns.get(TRAIN, 0)
            return [(step, (train if ns is None else ns) / 1e9) for step, ns in self._saves]

    def wall_s(self) -> float:
        """Seconds from the process's start to its end (to now while it runs)."""
        with self._lock:
            end = self._end if self._end is not None else time.perf_counter_ns()
            return max(0, end - self.started) / 1e9

    def started_steps(self) -> bool:
        with self._lock:
            return self._first is not None

    def to_dict(self, train_durations: Sequence[float] = (), train_steps: int = 0) -> dict | None:
        """The summary's ``job`` section as the file's dict (None before the first step)."""
        job = self.section(train_durations, train_steps)
        return None if job is None else job.to_dict()

    def section(self, train_durations: Sequence[float] = (), train_steps: int = 0) -> Job | None:
        """The summary's ``job`` section (None before the first step);
        ``train_durations``: the train step times (s) for the ideal step time, of
        ``train_steps`` steps (more when the list was thinned)."""
        with self._lock:
            if self._first is None:
                return None
            ns = {k: v for k, v in self._ns.items() if k != _PENDING}
            end = self._end if self._finished and self._end is not None else max(self._cursor, self.started)
            pending = self._ns.get(_PENDING, 0)
            if not self._finished:
                ns[SHUTDOWN] = ns.get(SHUTDOWN, 0) + pending
            wall = max(1, end - self.started)
            activities = {k: ns.get(k, 0) / 1e9 for k in BUILTIN}
            named = sorted((k for k in ns if k not in BUILTIN), key=lambda k: -ns[k])
            for k in named:
                activities[k] = ns[k] / 1e9
            ideal, badput, slow = slow_steps(train_durations, train_steps, self._compile_in_train / 1e9)
            save, load = self._ckpt_ops[SAVE], self._ckpt_ops[LOAD]
            calls = sorted(self._ckpt.items(), key=lambda kv: -kv[1][1])
            recompiled = sorted(self._compile_steps.items(), key=lambda kv: -kv[1][1])[:_MAX_RECOMPILED]
            return Job(
                wall_s=wall / 1e9,
                goodput=ns.get(TRAIN, 0) / wall,
                activities=activities,
                named=tuple(named),
                start=self.source,
                ideal_step_s=ideal,
                slow_step_badput_s=badput,
                slow_steps=slow,
                checkpoint=Checkpoint(
                    saves=save[0],
                    save_s=save[1] / 1e9,
                    loads=load[0],
                    load_s=load[1] / 1e9,
                    calls=tuple(CheckpointCall(name=k, count=c, total_s=t / 1e9) for k, (c, t) in calls),
                ),
                compile=Compile(
                    compilations=self._compiles,
                    recompilations=self.recompilations,
                    recompiled_at=tuple(
                        Recompiled(mode=mode, step=step, count=c, s=t / 1e9)
                        for (mode, step), (c, t) in sorted(recompiled, key=lambda kv: (kv[0][0] != TRAIN, kv[0][1]))
                    ),
                ),
            )

    # -- the accounting ----------------------------------------------------------------
    def _name(self, name: str) -> str:
        """The activity a user's named phase between steps counts in: its name (one of
        ours only where it means the same: ``checkpoint``, ``eval``, ``compile``)."""
        if name in (CHECKPOINT, EVAL, COMPILE):
            return name
        if name in BUILTIN or name == _PENDING:
            name = f"{name} (named)"
        if name in self._ns or sum(1 for k in self._ns if k not in BUILTIN and k != _PENDING) < _MAX_NAMES:
            return name
        return "(named)"

    def _unnamed(self, start: int, end: int) -> None:
        """Time in no step and no named phase: start-up before the first step, else
        pending (``other`` once a step follows, ``shutdown`` if none does)."""
        if end > start:
            self._carve(start, end, STARTUP if self._first is None else _PENDING)

    def _settle(self, activity: str) -> None:
        """The pending time after a step is ``activity`` now."""
        pending = self._ns.pop(_PENDING, 0)
        if pending:
            self._ns[activity] = self._ns.get(activity, 0) + pending
            for piece in self._recent:
                if piece[2] == _PENDING:
                    piece[2] = activity

    def _carve(self, start: int, end: int, activity: str, step: Any = None) -> None:
        """[start, end) is ``activity``, less the checkpoint and compile intervals in it
        (which count as themselves); unnamed pieces are kept for claims."""
        items = self.log.items
        ns = end - start
        at = start
        pieces: list[tuple[int, int]] = []
        while items:
            iv = items[0]
            if iv.start >= end:
                break
            lo, hi = max(iv.start, start), min(iv.end, end)
            if hi > lo:
                ns -= hi - lo
                if lo > at:
                    pieces.append((at, lo))
                at = max(at, hi)
                if activity == _PENDING:
                    self._between_activity += hi - lo
                if step is not None and iv.kind == COMPILE:
                    self._compile_hit(step, hi - lo, iv)
            if iv.end > end:
                break  # it goes on past this range: the next one takes the rest
            items.popleft()
            self._count(iv)
        if ns > 0:
            self._ns[activity] = self._ns.get(activity, 0) + ns
        if self._unmarked:
            self._mark()
        if step is None and activity in (STARTUP, _PENDING):
            if end > at:
                pieces.append((at, end))
            self._recent.extend([a, b, activity] for a, b in pieces)

    def _take(self, end: int) -> None:
        """Intervals up to ``end`` that no range held (after the cursor): counted."""
        items = self.log.items
        while items and items[0].start < end:
            self._count(items.popleft())
        if self._unmarked:
            self._mark()

    def _mark(self) -> None:
        """Saves counted since the last mark: the train time up to them (the step that
        held one included: its work is in the checkpoint)."""
        train = self._ns.get(TRAIN, 0)
        for save in reversed(self._saves):
            if save[1] is not None:
                break
            save[1] = train
        self._unmarked = False

    def _count(self, iv: Any) -> None:
        """One interval, whole, in its own activity."""
        ns = max(0, iv.end - max(iv.start, self.started))
        self._ns[iv.kind] = self._ns.get(iv.kind, 0) + ns
        if iv.kind == CHECKPOINT:
            slot = self._ckpt.get(iv.what)
            if slot is None:
                slot = self._ckpt[iv.what] = [0, 0]
            slot[0] += 1
            slot[1] += ns
            op = self._ckpt_ops.get(iv.op)
            if op is not None:
                op[0] += 1
                op[1] += ns
            if iv.op == SAVE and iv.step is not None:
                self._saves.append([iv.step, None])
                self._unmarked = True
        elif iv.kind == COMPILE:
            self._compiles += 1
            if iv.op == RECOMPILE:
                self.recompilations += 1
            elif iv.op == UNKNOWN:
                self._compile_ops_known = False

    def _compile_hit(self, step: Any, ns: int, iv: Any) -> None:
        """A compilation inside ``step``: kept out of its train time; without compile ids
        (torch before 2.6), one in a later step than the first compiling one is a
        recompilation."""
        key = (step.mode, step.number)
        if step.mode == TRAIN:
            self._compile_in_train += ns
        if self._first_compile_step is None:
            self._first_compile_step = key
        recompile = iv.op == RECOMPILE or (iv.op == UNKNOWN and key != self._first_compile_step)
        if not recompile:
            return
        if iv.op == UNKNOWN:
            self.recompilations += 1
        slot = self._compile_steps.get(key)
        if slot is None:
            if len(self._compile_steps) >= 4 * _MAX_RECOMPILED:
                return
            slot = self._compile_steps[key] = [0, 0]
        slot[0] += 1
        slot[1] += ns

    def _claim(self, start: int, end: int, name: str) -> None:
        """The unnamed pieces within [start, end] are the named phase's (it held steps)."""
        recent = self._recent
        kept: list[list] = []
        while recent and recent[-1][1] > start:
            a, b, activity = recent.pop()
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                self._ns[activity] = self._ns.get(activity, 0) - (hi - lo)
                self._ns[name] = self._ns.get(name, 0) + (hi - lo)
                if b > hi:
                    kept.append([hi, b, activity])
                if lo > a:
                    kept.append([a, lo, activity])
            else:
                kept.append([a, b, activity])
        recent.extend(sorted(kept))
