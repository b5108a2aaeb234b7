"""Profiles: torch.profiler over a few steps, asked for from any thread, run on the
training thread.

A trigger (``aggregate/profile_triggers.py``, on the pipeline thread) or a person
(``otel-training profile PID``) asks with :meth:`ProfileCapture.request`. The training
thread starts torch.profiler when it hands on a step at or past the requested position
and stops it once ``steps`` more steps are handed on; the stopped profiler goes to
``on_stopped`` (a worker thread of the runtime reads and writes it). Nothing of
torch.profiler is imported or alive while not capturing: while idle the training
thread's whole cost is one comparison per step (``Pipeline.submit``:
``step.train_before >= capture.due``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from otel_training import semconv as sc
from otel_training.record.timeline import StepTimeline

IDLE = sys.maxsize  # ``due`` while nothing is asked for
_EVERY_STEP = -1  # ``due`` while capturing: every step handed on is counted
ANCHOR = "otel_training::profile_anchor"  # a marker whose profiler time maps ops to our clock


class Request(NamedTuple):
    trigger: str  # slow, periodic, straggler, recompile, demand
    at: int  # start once a step with this many train steps before it is handed on (0: the next)
    steps: int  # steps to record
    detail: dict  # what the trigger saw (its step, own time, median), for the summary
    period: int | None = None  # a predicted step: started late, the capture waits a period more


class Capture:
    """One profile, as the training thread ran it (read by others once ``stop_ns`` is set)."""

    __slots__ = (
        "request",
        "sequence",
        "begin_ns",
        "start_ns",
        "stop_ns",
        "steps",
        "profiler",
        "anchor_ns",
        "path",
        "failure",
    )

    def __init__(self, request: Request, sequence: int) -> None:
        self.request = request
        self.sequence = sequence  # this process's profiles, from 1
        self.begin_ns = time.perf_counter_ns()  # before torch.profiler started (its start-up is ours)
        self.start_ns = 0  # perf_counter_ns when torch.profiler was recording
        self.stop_ns = 0  # perf_counter_ns before it stopped (0 while recording)
        self.steps: list[tuple[str, int]] = []  # (mode, number) of each step handed on while recording
        self.profiler: Any = None  # the stopped torch.profiler.profile (the worker reads it, then drops it)
        self.anchor_ns = 0  # our clock inside the ANCHOR range
        self.path: str | None = None  # the trace file, named at the first recorded step
        self.failure: str | None = None  # why the capture failed, if it did


class ProfileCapture:
    """Starts and stops torch.profiler at step hand-overs. ``namer(capture, mode,
    number)`` gives the trace file's path at the first recorded step; ``on_stopped``
    takes each finished capture (on the training thread: it must only queue it)."""

    def __init__(
        self,
        namer: Callable[[Capture, str, int], str],
        on_stopped: Callable[[Capture], None],
        on_error: Callable[[str, BaseException], None],
        cuda: Callable[[], bool],
    ) -> None:
        self.due = IDLE  # read lock-free by the training thread at every hand-over
        self._lock = threading.Lock()
        self._namer = namer
        self._on_stopped = on_stopped
        self._on_error = on_error
        self._cuda = cuda
        self._pending: Request | None = None
        self._active: Capture | None = None
        self._count = 0
        self._reading = False  # a stopped capture's results are being read (one session at a time)
        self._pid = os.getpid()
        self.broken: str | None = None  # why profiling is off for the rest of the run

    IDLE = IDLE

    @property
    def busy(self) -> bool:
        """A capture is asked for, recording, or being read."""
        return self._pending is not None or self._active is not None or self._reading

    @property
    def active(self) -> Capture | None:
        """The capture recording now, if any."""
        return self._active

    @property
    def next_sequence(self) -> int:
        """The sequence number the next capture will have."""
        return self._count + 1

    def done_reading(self) -> None:
        """The last stopped capture has been read (its worker is done with torch's results)."""
        self._reading = False

    def request(self, request: Request) -> bool:
        """Ask for a capture (any thread); False while one is asked for, recording or
        being read."""
        with self._lock:
            if self.broken is not None or self.busy:
                return False
            self._pending = request
            self.due = request.at
            return True

    # -- training thread ------------------------------------------------------------------
    def fire(self, step: StepTimeline) -> None:
        """A step is handed on at or past ``due``: start, count or stop."""
        try:
            if os.getpid() != self._pid:  # a forked child: the parent's capture is not ours
                self.due = IDLE
                return
            active = self._active
            if active is None:
                pending = self._pending
                if pending is not None and pending.period and step.train_before > pending.at:
                    # Past the predicted step: wait for its next occurrence.
                    late = step.train_before - pending.at
                    at = pending.at + pending.period * -(-late // pending.period)
                    if at > step.train_before:
                        with self._lock:
                            if self._pending is pending:
                                self._pending = pending._replace(at=at)
                                self.due = at
                        return
                self._start()
            else:
                self._count_step(active, step)
        except Exception as exc:  # our bug or torch's refusal: profiling stops, training does not
            self._give_up(exc)

    def stop(self) -> None:
        """End a capture still recording (the run ends inside it); forget one asked for."""
        with self._lock:
            self._pending = None
            if self._active is None:
                self.due = IDLE
                return
        try:
            self._finish(self._active)
        except Exception as exc:
            self._give_up(exc)

    def _start(self) -> None:
        with self._lock:
            request = self._pending
            self._pending = None
            if request is None:
                self.due = IDLE
                return
            self._count += 1
            capture = Capture(request, self._count)
            self._active = capture
            self.due = _EVERY_STEP
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU]
        if self._cuda():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities, record_shapes=False, profile_memory=False, with_stack=False)
        prof.start()
        capture.profiler = prof
        with record_function(ANCHOR):
            capture.anchor_ns = time.perf_counter_ns()
        capture.start_ns = time.perf_counter_ns()

    def _count_step(self, capture: Capture, step: StepTimeline) -> None:
        mode = sc.MODE_TRAIN if (step.saw_backward or step.saw_optimizer) else sc.MODE_EVAL
        if not capture.steps:
            capture.path = self._namer(capture, mode, step.index)
        capture.steps.append((mode, step.index))
        if len(capture.steps) >= capture.request.steps:
            self._finish(capture)

    def _finish(self, capture: Capture) -> None:
        capture.stop_ns = time.perf_counter_ns()
        try:
            if capture.profiler is not None:
                capture.profiler.stop()
        finally:
            with self._lock:
                self._active = None
                self._reading = True
                self.due = IDLE if self._pending is None else self._pending.at
            self._on_stopped(capture)

    def _give_up(self, exc: BaseException) -> None:
        capture = self._active
        with self._lock:
            self._active = None
            self._pending = None
            self.due = IDLE
            self.broken = f"{type(exc).__name__}: {exc}"
        if capture is not None:
            capture.failure = self.broken
            if not capture.stop_ns:
                capture.stop_ns = time.perf_counter_ns()
            prof = capture.profiler
            capture.profiler = None
            if prof is not None:
                try:
                    prof.stop()
                except Exception:  # (already stopped, or never started)
                    pass
            try:
                self._on_stopped(capture)
            except Exception:
                pass
        self._on_error("profile", exc)
