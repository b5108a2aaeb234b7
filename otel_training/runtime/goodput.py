"""Goodput: the whole process's wall time by activity, wired together.

- training thread: checkpoint calls and compilations timed into an ``ActivityLog``
  (``record/activities.py``);
- pipeline thread: the ``JobClock`` (``aggregate/job.py``), a consumer of steps and
  named time between steps, splits the process's wall time into activities;
- collection: ``training.job.time`` and ``training.goodput`` (``export/job.py``).

``Runtime`` makes one ``Goodput`` before its pipeline (the clock is one of its
consumers), installs it with the other hooks, marks the end when the program's code
returns, finishes it once the pipeline has stopped, and adds its ``job`` section to
the summary.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from otel_training.aggregate.job import JobClock
from otel_training.record.activities import Activities, ActivityLog

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

    def __init__(self, on_error: Callable[[str, BaseException], None]) -> None:
        now = time.perf_counter_ns()
        started, source = process_start_ns(now)
        if started is None:  # no procfs nor psutil: from when instrumentation began
            started, source = now, "instrumentation"
        self.log = ActivityLog()
        self.clock = JobClock(started, self.log, source)
        self.activities: Activities | None = None
        self._on_error = on_error

    def install(self, tracker: Any, handles: Any, meter: Any, attributes: dict) -> None:
        """Time checkpoints and compilations on ``tracker``'s thread (removed with
        ``handles``) and register the instruments on ``meter``."""
        try:
            self.activities = handles.add(Activities(tracker, self.log, self._on_error))
            self.activities.install()
        except Exception as exc:  # steps are timed all the same; the activities count as their surroundings
            self._on_error("activities", exc)
        try:
            from otel_training.export import job

            job.register(meter, self.clock, attributes, self._on_error)
        except Exception as exc:
            self._on_error("metrics", exc)

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

    def summarize(self, summary: dict, run_summary: Any) -> None:
        """Add the ``job`` section (after the first step) to a run summary."""
        try:
            durations, steps = run_summary.step_durations("train")
            job = self.clock.to_dict(durations, steps)
            if job is not None:
                summary["job"] = job
        except Exception as exc:
            self._on_error("summary", exc)

    def self_check(self, coverage: Any, tracker: Tracker) -> list[dict]:
        """The coverage self-check, with checkpoint and compile time between steps
        accounted for, and low coverage only where model work ran outside steps."""
        try:
            unstepped = tracker.unstepped
            return coverage.self_check(self.clock.between_activity_ns(), unstepped)
        except Exception as exc:
            self._on_error("summary", exc)
            return coverage.self_check()
