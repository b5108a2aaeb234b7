"""Ground truth for the loop-shape scripts in this folder.

Each script counts what it really did while it runs (its optimizer updates, backward
passes, eval batches) and measures every delay it plants with ``time.perf_counter()``
around the sleep. At the end it prints one line ``TRUTH {json}``:

    train_steps, eval_steps, microbatches, skipped_updates  counts, as the script saw them
    loop_wall_s        from just before the first loop to just after the last
    planted            {mode: {phase name: mean seconds per step of that mode}}
    planted_total_s    the same as totals (seconds)
    planted_step_max_s the most of it that fell between two counts of that mode (one
                       step's worth), to allow for the one step the summary leaves out
    timed_user_code_s  the measured user code (``timed()``) among them, for reference
    planted_outside_s  time planted or measured between two steps (``OUTSIDE``, below)
    outside_after_last_step_s  the same after the last step (still in loop_wall_s)
    outside_loop_ends  DataLoader loops that ended between two steps (``loop_end()``)
    before_first_step_s  timed user code before the first step (``BEFORE``), for reference
    samples            {mode: samples the steps of that mode consumed} (``samples()``), only
                       in scripts that count them
    loader_work_s      {mode: seconds}: the DataLoader's own work around the planted
                       delays (fetch, collate, the iterator's bookkeeping: each fetch's
                       time less the planted sleeps inside it, by the script's clock),
                       booked to the mode whose delay the fetch held; it grows on a
                       loaded machine, and ``dataloader_next`` holds it too
    named              {name: {"count": n, "total_s": s}}: blocks the script ran inside its
                       own ``otel_training.phase(name)`` with no step open (``named()``),
                       only in scripts that name time between steps

Phase names are the ones the summary uses: ``dataloader_next`` (a slow Dataset
``__getitem__`` / ``collate_fn``), ``untracked`` (user code: logging, env simulation,
plotting), ``callback.<Class>.<hook>`` (Lightning / Transformers callbacks). Besides
sleeps, ``timed()`` measures a block of the loop's own user code that lands in a step's
``untracked`` time (a checkpoint save, a metric computation): it is part of the truth.

Time that lies *between* steps (docs/steps.md: after a DataLoader loop ends, the
``StopIteration`` and whatever runs after the ``for`` loop until the next step begins)
is planted with ``sleep_outside()`` (or ``sleep(OUTSIDE, ...)``) and measured with
``timed(OUTSIDE, ...)``; ``loop_end()`` marks the end of such a loop. It is kept apart:
it belongs to no mode and no phase. Outside time followed by a step counted later lies
between two steps (the summary's ``coverage.outside_s``); outside time after the last
counted step lies after the loop the summary measures, but within ``loop_wall_s``.
Time the script names between steps (``otel_training.phase(name)`` with no step open: a
checkpoint between epochs, a save after the last step) is measured with ``named(name)``
inside that phase, and kept apart from the outside time: otel-training lists it as
named time (``coverage.named``), not as ``coverage.outside_s``. Named time after the last
step is still inside the loop the summary measures: outside time before it lies between
steps.
A block that runs both before the first step and in later steps' tails (the top of a
loop body) is timed as ``BEFORE`` on its first run: that time is in no step.

When the test suite runs several scripts at once (``LOOPS_LOOP_LOCK``, a lock file, and
``LOOPS_PIDS_DIR``, a folder with one file named after each running script's pid),
``start()`` takes the lock and stops (SIGSTOP) the other scripts, and ``stop()``
resumes them (SIGCONT) and releases it. So a script times its loop alone on the
machine, while the others may import and set up whenever no loop is being timed: on
2 cores, a loop sharing the CPU with another busy process picks up several percent of
scheduling noise. (The runner also resumes everyone when a script exits.)
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Dict, List, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

TRAIN, EVAL = "train", "eval"
OUTSIDE = "outside"  # between steps: no mode, no phase
BEFORE = "before"  # user code before the first step: in no step (kept for reference only)


class Truth:
    def __init__(self, script: str) -> None:
        self.script = script
        self.train_steps = 0
        self.eval_steps = 0
        self.microbatches = 0
        self.skipped_updates = 0
        self._planted: Dict[str, Dict[str, float]] = {TRAIN: {}, EVAL: {}}  # sleeps
        self._timed: Dict[str, Dict[str, float]] = {TRAIN: {}, EVAL: {}}  # measured user code
        self._t0: Optional[float] = None
        self._t1: Optional[float] = None
        self.notes: Dict[str, object] = {}
        self._lock_fd: Optional[int] = None
        self._stopped: List[int] = []
        self._slept = 0.0  # all planted sleeps so far
        self._outside = 0.0  # outside time (planted + measured) with a step counted after it
        self._outside_pending = 0.0  # outside time with no step counted after it (yet)
        self._loop_ends = 0  # DataLoader loop ends with a step counted after them
        self._loop_ends_pending = 0
        self._before = 0.0  # timed user code before the first step
        self._samples: Dict[str, int] = {}  # samples consumed, by mode (scripts that count them)
        self._named: Dict[str, List[float]] = {}  # name -> [count, seconds]: named time between steps
        # (mode, phase) -> {steps of that mode counted so far: seconds}: what each step's
        # stretch held, for the most any one step held (``planted_step_max_s``)
        self._by_step: Dict[tuple, Dict[int, float]] = {}
        self._fetch_slept = 0.0  # planted sleeps so far, Ledger's too (for a fetch's own work)
        self._fetch_mode: Optional[str] = None  # the mode of the delay the current fetch held
        self._loader_work: Dict[str, float] = {TRAIN: 0.0, EVAL: 0.0}
        self._unbooked_work = 0.0  # fetch work with no mode yet (a Ledger books it later)
        _watch_fetches(self)

    # -- the loop's wall time ---------------------------------------------------------
    def start(self) -> None:
        """Just before the first loop."""
        if self._t0 is None:
            self._lock()
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        """Just after the last loop."""
        self._t1 = time.perf_counter()
        self._unlock()

    def _lock(self) -> None:
        path, pids = os.environ.get("LOOPS_LOOP_LOCK"), os.environ.get("LOOPS_PIDS_DIR")
        if not (path and pids) or fcntl is None:
            return
        self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        for name in os.listdir(pids):
            if name.isdigit() and int(name) != os.getpid():
                try:
                    os.kill(int(name), signal.SIGSTOP)
                    self._stopped.append(int(name))
                except OSError:
                    pass  # it has exited

    def _unlock(self) -> None:
        for pid in self._stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        self._stopped = []
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- counts -----------------------------------------------------------------------
    def train_step(self, microbatches: int = 1, skipped: bool = False) -> None:
        """One optimizer update (or, with no optimizer, one backward pass) happened;
        ``microbatches`` backward passes went into it before its first update."""
        assert microbatches >= 1, "a train step has at least one backward pass"
        self._step_counted()
        self.train_steps += 1
        self.microbatches += microbatches
        self.skipped_updates += int(bool(skipped))

    def eval_step(self, n: int = 1) -> None:
        """``n`` forward batches without backward happened."""
        if n:
            self._step_counted()
        self.eval_steps += n

    def samples(self, mode: str, n: int) -> None:
        """A step of ``mode`` consumed ``n`` samples of data (each batch once, however
        many forwards or backward passes used it)."""
        self._samples[mode] = self._samples.get(mode, 0) + int(n)

    def _step_counted(self) -> None:
        """A step was counted (or named time began, which ends the summary's loop no
        sooner than it does): outside time so far lies before it, between two steps.
        (Call ``sleep_outside()`` only once the step before it has been counted.)"""
        self._outside += self._outside_pending
        self._loop_ends += self._loop_ends_pending
        self._outside_pending, self._loop_ends_pending = 0.0, 0

    def loop_end(self) -> None:
        """A DataLoader ``for`` loop just ended (its ``StopIteration``): until the next
        step begins, time lies between steps."""
        self._loop_ends_pending += 1

    # -- planted delays ---------------------------------------------------------------
    def sleep(self, mode: str, phase: str, seconds: float) -> float:
        """Sleep ``seconds`` as a planted delay that lands in ``phase`` of a ``mode``
        step; returns (and records) the time really slept."""
        t = time.perf_counter()
        time.sleep(seconds)
        dt = time.perf_counter() - t
        self.add(mode, phase, dt)
        self._slept += dt
        self._fetch_slept += dt
        if phase == "dataloader_next" and mode in self._loader_work:
            self._fetch_mode = mode
        return dt

    def sleep_outside(self, seconds: float) -> float:
        """Sleep ``seconds`` between two steps (after a DataLoader loop ended, before
        the next step begins); returns (and records) the time really slept."""
        return self.sleep(OUTSIDE, "outside", seconds)

    def timed(self, mode: str, phase: str) -> _Timed:
        """Measure a block of the script's own code that lands in ``phase`` of a
        ``mode`` step (it must run no forward, backward, optimizer step, loader or
        ``.item()``/``.cpu()``); planted sleeps inside it are not counted twice.
        (A small class rather than ``contextlib.contextmanager``: a few microseconds
        less of the timer's own time outside what it measures, in blocks run hundreds
        of times per step.)"""
        return _Timed(self, mode, phase)

    def named(self, name: str) -> _Named:
        """Measure a block run inside the script's ``otel_training.phase(name)`` with no
        step open (named time between steps); its sleeps are plain ``time.sleep``."""
        return _Named(self, name)

    def _add_timed(self, mode: str, phase: str, seconds: float) -> None:
        if mode == BEFORE:
            self._before += seconds
        elif mode == OUTSIDE:
            self._outside_pending += seconds
        else:
            slot = self._timed[mode]
            slot[phase] = slot.get(phase, 0.0) + seconds
            self._in_step(mode, phase, seconds)

    def add(self, mode: str, phase: str, seconds: float) -> None:
        if mode == OUTSIDE:
            self._outside_pending += seconds
            return
        if mode == BEFORE:
            self._before += seconds
            return
        slot = self._planted[mode]
        slot[phase] = slot.get(phase, 0.0) + seconds
        self._in_step(mode, phase, seconds)

    def _in_step(self, mode: str, phase: str, seconds: float) -> None:
        steps = self._by_step.setdefault((mode, phase), {})
        n = self.train_steps if mode == TRAIN else self.eval_steps
        steps[n] = steps.get(n, 0.0) + seconds

    # -- the TRUTH line ---------------------------------------------------------------
    def as_dict(self) -> dict:
        assert self._t0 is not None and self._t1 is not None, "start() and stop() the loop"
        steps = {TRAIN: self.train_steps, EVAL: self.eval_steps}
        # Where a delay is planted, the measured user code of that phase adds to it; a
        # phase with only timed user code (no sleep) is too small to check.
        totals = {mode: {k: v + self._timed[mode].get(k, 0.0) for k, v in d.items()}
                  for mode, d in self._planted.items() if d}
        planted = {mode: {k: v / steps[mode] for k, v in d.items()} for mode, d in totals.items() if steps[mode]}
        return {
            "script": self.script,
            "train_steps": self.train_steps,
            "eval_steps": self.eval_steps,
            "microbatches": self.microbatches,
            "skipped_updates": self.skipped_updates,
            "loop_wall_s": self._t1 - self._t0,
            "planted": planted,
            "planted_total_s": totals,
            "planted_step_max_s": {mode: {k: max(self._by_step.get((mode, k), {0: 0.0}).values()) for k in d}
                                   for mode, d in totals.items()},
            "timed_user_code_s": {m: d for m, d in self._timed.items() if d},
            "loader_work_s": dict(self._loader_work),
            "planted_outside_s": self._outside,
            "outside_after_last_step_s": self._outside_pending,
            "outside_loop_ends": self._loop_ends,
            "before_first_step_s": self._before,
            "notes": self.notes,
            **({"samples": dict(self._samples)} if self._samples else {}),
            **({"named": {k: {"count": int(c), "total_s": t} for k, (c, t) in self._named.items()}}
               if self._named else {}),
        }

    def emit(self) -> None:
        print("TRUTH " + json.dumps(self.as_dict(), sort_keys=True), flush=True)


class _Timed:
    """``Truth.timed()``: the block's time, less the planted sleeps inside it (they are
    counted once, as planted)."""

    __slots__ = ("mode", "phase", "slept", "t", "truth")

    def __init__(self, truth: Truth, mode: str, phase: str) -> None:
        self.truth, self.mode, self.phase = truth, mode, phase

    def __enter__(self) -> None:
        self.slept = self.truth._slept
        self.t = time.perf_counter()

    def __exit__(self, *exc) -> bool:
        t1 = time.perf_counter()
        self.truth._add_timed(self.mode, self.phase, (t1 - self.t) - (self.truth._slept - self.slept))
        return False


class _Named:
    """``Truth.named()``: one more block of named time between steps, and its seconds."""

    __slots__ = ("name", "t", "truth")

    def __init__(self, truth: Truth, name: str) -> None:
        self.truth, self.name = truth, name

    def __enter__(self) -> None:
        self.truth._step_counted()  # outside time before named time lies within the loop too
        self.t = time.perf_counter()

    def __exit__(self, *exc) -> bool:
        dt = time.perf_counter() - self.t
        slot = self.truth._named.setdefault(self.name, [0, 0.0])
        slot[0] += 1
        slot[1] += dt
        return False


class Ledger:
    """A Dataset's planted sleeps, measured as they happen and booked later, to the step
    that turns out to use the batch: ``book(mode)`` adds them to ``mode``'s
    ``dataloader_next`` (``OUTSIDE``: to the time between steps, a batch no step used)."""

    def __init__(self, truth: Truth) -> None:
        self.truth = truth
        self.slept = 0.0

    def sleep(self, seconds: float) -> None:
        t = time.perf_counter()
        time.sleep(seconds)
        dt = time.perf_counter() - t
        self.slept += dt
        self.truth._fetch_slept += dt

    def book(self, mode: str) -> None:
        self.truth.add(mode, "outside" if mode == OUTSIDE else "dataloader_next", self.slept)
        self.slept = 0.0
        if mode in self.truth._loader_work:
            self.truth._loader_work[mode] += self.truth._unbooked_work
        self.truth._unbooked_work = 0.0


def _watch_fetches(truth: Truth) -> None:
    """Time each DataLoader fetch (``_next_data``, inside the iterator's ``__next__``
    that otel-training watches) by the script's clock: its time less the planted sleeps
    inside it is the loader's own work, booked to the mode of the delay it held (or left
    for a ``Ledger`` to book with its sleeps)."""
    try:
        from torch.utils.data import dataloader as dl
    except ImportError:  # pragma: no cover - every script has torch
        return
    for cls in (dl._SingleProcessDataLoaderIter, dl._MultiProcessingDataLoaderIter):
        inner = cls.__dict__.get("_next_data")
        if inner is None or getattr(inner, "_truth_timed", False):
            continue

        def timed(self, _inner=inner):
            t, slept = time.perf_counter(), truth._fetch_slept
            outer_mode, truth._fetch_mode = truth._fetch_mode, None
            try:
                return _inner(self)
            finally:
                work = max(0.0, time.perf_counter() - t - (truth._fetch_slept - slept))
                if truth._fetch_mode is not None:
                    truth._loader_work[truth._fetch_mode] += work
                else:
                    truth._unbooked_work += work
                truth._fetch_mode = outer_mode

        timed._truth_timed = True  # type: ignore[attr-defined]
        setattr(cls, "_next_data", timed)
