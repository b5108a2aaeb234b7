"""Goodput: the whole process's wall time by activity, wired together.

- training thread: checkpoint calls and compilations timed into an ``ActivityLog``
  (``record/activities.py``);
- pipeline thread: the ``JobClock`` (``aggregate/job.py``), a consumer of steps and
  named time between steps, splits the process's wall time into activities;
- collection: ``training.job.time`` and ``training.goodput`` (``export/job.py``).

- a restarted run: this attempt's record, and the earlier attempts' (``attempts.py``);
  a writer thread rewrites the record every ``WRITE_EVERY_S`` seconds.

``Runtime`` makes one ``Goodput`` before its pipeline (the clock is one of its
consumers), installs it with the other hooks, marks the end when the program's code
returns, finishes it once the pipeline has stopped, and adds its ``job`` section to
the summary.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from otel_training.aggregate.job import JobClock
from otel_training.aggregate.run_model import Attempt, CheckFinding, Job, RunView
from otel_training.record.activities import Activities, ActivityLog
from otel_training.record.global_step import GlobalStep
from otel_training.runtime.attempts import WRITE_EVERY_S, AttemptFile, lost_progress, prune, run_view

SAVE_SETTLE_S = 1.0  # after a checkpoint save, the record is rewritten once the pipeline took it in

if TYPE_CHECKING:
    from otel_training.record.tracker import Tracker


def process_start_ns(now_ns: int) -> tuple[int | None, str]:
    """When this process started, on the ``perf_counter_ns`` clock read as ``now_ns``,
    and where that came from: the kernel's start time (``/proc``: exec'd launchers such
    as ``opentelemetry-instrument`` keep the process), else psutil; (None, "") when
    neither tells."""
    age = None
    source = ""
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        # Field 22 (start time, clock ticks after boot), counted after the command name,
        # which may hold spaces and parentheses: after its last ")".
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        boot = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        age = boot - ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        source = "proc"
    except (OSError, ValueError, IndexError, AttributeError):
        psutil = sys.modules.get("psutil")
        if psutil is None:
            try:
                import psutil  # type: ignore[no-redef]
            except Exception:
                psutil = None
        if psutil is not None:
            try:
                age = time.time_ns() - int(psutil.Process().create_time() * 1e9)
                source = "psutil"
            except Exception:
                age = None
    # A start time in the future, or days off (a clock namespace), is not believed.
    if age is None or age < 0 or age > 30 * 86_400 * 1_000_000_000:
        return None, ""
    return now_ns - age, source


class Goodput:
    """The activity log, the clock and its instruments of one runtime."""

    def __init__(self, on_error: Callable[[str, BaseException], None], attempts: AttemptFile | None = None) -> None:
        now = time.perf_counter_ns()
        started, source = process_start_ns(now)
        if started is None:  # no procfs nor psutil: from when instrumentation began
            started, source = now, "instrumentation"
        self._offset = time.time_ns() - now  # perf_counter ns -> epoch ns
        self.log = ActivityLog()
        self.clock = JobClock(started, self.log, source)
        self.global_step = GlobalStep()  # told by the framework integrations
        self.activities: Activities | None = None
        self.attempts = attempts
        self._stop = threading.Event()
        self._saved = threading.Event()  # a checkpoint was saved: rewrite the record soon
        self._writer: threading.Thread | None = None
        self._unwritable = False  # the attempt file could not be written: not tried again
        self._on_error = on_error

    def install(self, tracker: Any, handles: Any, meter: Any, attributes: dict) -> None:
        """Time checkpoints and compilations on ``tracker``'s thread (removed with
        ``handles``) and register the instruments on ``meter``."""
        try:
            self.activities = handles.add(
                Activities(tracker, self.log, self._on_error, self.global_step, on_save=self._saved.set)
            )
            self.activities.install()
        except Exception as exc:  # steps are timed all the same; the activities count as their surroundings
            self._on_error("activities", exc)
        if self.attempts is not None:
            self._restarted()
        try:
            from otel_training.export import job

            job.register(meter, self.clock, attributes, self._on_error)
        except Exception as exc:
            self._on_error("metrics", exc)

    def rebind(self, meter: Any, attributes: dict) -> None:
        """Report the job instruments under ``attributes`` (the rank, once known)."""
        try:
            from otel_training.export import job

            job.register(meter, self.clock, attributes, self._on_error)
        except Exception as exc:
            self._on_error("metrics", exc)

    # -- a restarted run --------------------------------------------------------------------
    def _restarted(self) -> None:
        """Read the earlier attempts (the restart before this one counts from the last's
        end), and keep this one's record from now on."""
        attempts = self.attempts
        assert attempts is not None
        try:
            previous = attempts.load()
            if previous:
                ended = float(previous[-1].get("ended_unix") or 0.0)
                started = (self.clock.started + self._offset) / 1e9
                self.clock.restart_s = max(0.0, started - ended) if ended else 0.0
            self._writer = threading.Thread(target=self._write_every, name="otel-training-attempts", daemon=True)
            self._writer.start()
        except Exception as exc:  # no restart counted; training goes on
            self.attempts = None
            self._on_error("attempts", exc)

    def _write_every(self) -> None:
        """Every ``WRITE_EVERY_S``, and after each checkpoint save (a killed attempt's
        next one resumes from a save: its record should know it). First, old runs'
        folders go (``attempts.prune``), off the training thread."""
        attempts = self.attempts
        if attempts is not None:
            prune(attempts.path.parent.parent, keep=attempts.path.parent)
        while not self._stop.is_set():
            if self._saved.wait(WRITE_EVERY_S):
                self._saved.clear()
                if self._stop.wait(SAVE_SETTLE_S):  # the pipeline drains every 0.5 s
                    return
            if self._stop.is_set():
                return
            if self.clock.started_steps():
                self._write(final=False)

    def _write(self, final: bool) -> None:
        attempts = self.attempts
        if attempts is None or self._unwritable:
            return
        try:
            attempts.write(self.record(final))
        except OSError as exc:  # the user's folder: said once; a later attempt counts no restart
            self._unwritable = True
            print(
                f"otel-training: OTEL_TRAINING_ATTEMPTS_DIR={str(attempts.path.parent.parent)!r} cannot be "
                f"written ({exc.strerror or type(exc).__name__}): use a writable folder, or none (a restart "
                "of this run will not be counted; training continues)",
                file=sys.stderr,
                flush=True,
            )
        except Exception as exc:  # our bug: counted, never the user's problem
            self._unwritable = True
            self._on_error("attempts", exc)

    def record(self, final: bool) -> dict:
        """This attempt as the next one reads it (attempts.py)."""
        clock = self.clock
        totals = clock.totals()
        wall = clock.wall_s()
        started = (clock.started + self._offset) / 1e9
        attempts = self.attempts
        previous = attempts.previous[-1] if attempts is not None and attempts.previous else None
        resumed = self.global_step.resumed_at
        steps, lost = lost_progress(previous, resumed) if previous is not None else (0, 0.0)
        return {
            "attempt": attempts.number if attempts is not None else 0,
            "restart_count": attempts.restart_count if attempts is not None else None,
            "pid": os.getpid(),
            "started_unix": started,
            "ended_unix": started + wall,
            "final": final,
            "wall_s": wall,
            "activities": totals,
            "train_s": totals.get("train", 0.0),
            "restart_s": clock.restart_s,
            "lost_progress_s": lost,
            "lost_steps": steps,
            "resumed_at": resumed,
            "global_step": self.global_step.current(),
            "saves": [[step, train] for step, train in clock.saves()],
        }

    def abandon(self) -> None:
        """A child process (a DataLoader worker): no record of its own."""
        self.attempts = None
        self._stop.set()
        self._saved.set()

    def end(self) -> None:
        """The program is exiting: its wall time ends here (the first call counts)."""
        try:
            self.clock.end()
        except Exception as exc:
            self._on_error("shutdown", exc)

    def finish(self) -> None:
        """Every step is in: the time after the last one is accounted."""
        try:
            self.clock.end()
            self.clock.finish()
        except Exception as exc:
            self._on_error("shutdown", exc)
        self._stop.set()
        self._saved.set()  # (the writer leaves its wait)
        if self.attempts is not None and self.clock.started_steps():
            writer = self._writer
            if writer is not None and writer is not threading.current_thread():
                writer.join(1.0)  # a periodic write under way ends before the last one
            self._write(final=True)

    def job(self, run_summary: Any) -> Job | None:
        """The summary's ``job`` section (None before the first step, or on our error)."""
        try:
            durations, steps = run_summary.step_durations("train")
            job = self.clock.section(durations, steps)
            return None if job is None else self._attempt(job)
        except Exception as exc:
            self._on_error("summary", exc)
            return None

    def _attempt(self, job: Job) -> Job:
        """A restarted run: this attempt's restart and lost progress, and the run over
        its attempts."""
        attempts = self.attempts
        if attempts is None or not attempts.previous:
            return job
        current = self.record(final=True)
        previous = attempts.previous[-1]
        attempt = Attempt(
            number=attempts.number,
            restart_s=current["restart_s"],
            lost_progress_s=current["lost_progress_s"],
            lost_steps=current["lost_steps"],
            resumed_at_step=current["resumed_at"],
            previous_last_step=previous.get("global_step"),
            previous_exit="recorded" if previous.get("final") else "killed (its last record)",
        )
        return replace(job, attempt=attempt, run=RunView(**run_view([*attempts.previous, current])))

    def self_check(self, coverage: Any, tracker: Tracker) -> tuple[CheckFinding, ...]:
        """The coverage self-check, with checkpoint and compile time between steps
        accounted for, and low coverage only where model work ran outside steps."""
        try:
            unstepped = tracker.unstepped
            return coverage.check(self.clock.between_activity_ns(), unstepped)
        except Exception as exc:
            self._on_error("summary", exc)
            return coverage.check()
