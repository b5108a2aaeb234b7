"""Profiles armed by the run (``OTEL_TRAINING_PROFILE``, docs/profiles.md): the
capture, its triggers, the worker that writes and reads each profile, and the
on-demand requests of ``otel-training profile PID``.

On demand: the job watches ``demand_dir()/<pid>.request`` once a second (a thread
that only stats a file) and announces itself with ``<pid>.listening``; the answer,
once the profile is read, is ``<pid>.<id>.result.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from otel_training.aggregate.profile_ops import Caught, read
from otel_training.aggregate.profile_summary import profiles_section
from otel_training.aggregate.profile_triggers import ProfileTriggers
from otel_training.aggregate.run_sections import Profiles
from otel_training.config import Config
from otel_training.record.profile_capture import Capture, ProfileCapture, Request

_POLL_S = 1.0
_RESULT_WAIT_S = 5.0  # a demand's answer waits this long for its steps' records
MAX_DEMAND_STEPS = 20


def demand_dir() -> str:
    """Where ``otel-training profile PID`` and the job meet (per user)."""
    return os.path.join(tempfile.gettempdir(), f"otel-training-{os.getuid()}", "profile")


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:
        return False


class Profiling:
    """One runtime's profiles. ``identity()``: (run id, rank or None)."""

    def __init__(
        self,
        config: Config,
        identity: Callable[[], tuple[str, int | None]],
        world_size: Callable[[], int | None],
        recompilations: Callable[[], int],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self._config = config
        self._identity = identity
        self._on_error = on_error
        self.captures: list[Capture] = []  # stopped, in order (training thread appends)
        self.caught: dict[int, Caught | str] = {}  # per capture: its operators, or why not (workers)
        self._read_ns: dict[int, int] = {}  # per capture: when its worker was done (perf_counter_ns)
        self._workers: list[threading.Thread] = []
        self._demands: dict[int, str] = {}  # capture sequence -> the request id to answer
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self.capture = ProfileCapture(self._name, self._stopped, on_error, _cuda_in_use)
        triggers = tuple(t for t in config.profile if t != "demand")
        self.triggers = ProfileTriggers(
            self.capture,
            triggers,
            steps=config.profile_steps,
            max_profiles=config.profile_max,
            interval_s=config.profile_interval,
            world_size=world_size,
            recompilations=recompilations,
            captures=self._captures,
            read_until=self._read_until,
        )
        self.demand = "demand" in config.profile

    # -- the capture's callbacks ----------------------------------------------------------
    def _captures(self) -> list[Capture]:
        active = self.capture.active
        return [*self.captures, active] if active is not None else list(self.captures)

    def _read_until(self, capture: Capture) -> int:
        return self._read_ns.get(capture.sequence, sys.maxsize)

    def _name(self, capture: Capture, mode: str, number: int) -> str:
        run, rank = self._identity()
        folder = (
            self._config.profile_dir
            or self._summary_folder()
            or os.path.join(tempfile.gettempdir(), "otel-training-profiles")
        )
        os.makedirs(folder, exist_ok=True)
        who = f"rank{rank}" if rank is not None else f"pid{os.getpid()}"
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)
        name = f"profile-{safe}-{who}-{capture.request.trigger}-{mode}{number}.json"
        return os.path.join(folder, name)

    def _summary_folder(self) -> str | None:
        path = self._config.summary_file
        if not path:
            return None
        _, rank = self._identity()
        path = path.replace("{rank}", str(rank) if rank is not None else "unknown").replace("{pid}", str(os.getpid()))
        return os.path.dirname(os.path.abspath(path))

    def _stopped(self, capture: Capture) -> None:
        """(training thread) hand the stopped profiler to a worker of its own."""
        self.captures.append(capture)
        if capture.profiler is None:
            self.caught[capture.sequence] = capture.failure or "the profiler did not start"
            self._read_ns[capture.sequence] = time.perf_counter_ns()
            self.capture.done_reading()
            return
        worker = threading.Thread(target=self._read, args=(capture,), name="otel-training-profile", daemon=True)
        self._workers.append(worker)
        worker.start()

    def _read(self, capture: Capture) -> None:
        try:
            self.caught[capture.sequence] = read(capture)
        except Exception as exc:  # the file or torch's parsing failed: said in the summary
            self.caught[capture.sequence] = f"{type(exc).__name__}: {exc}"
            self._on_error("profile", exc)
        finally:
            self._read_ns[capture.sequence] = time.perf_counter_ns()
            self.capture.done_reading()
        demand = self._demands.pop(capture.sequence, None)
        if demand is not None:
            self._answer(capture, demand)

    # -- on demand ----------------------------------------------------------------------
    def start(self) -> None:
        """Listen for ``otel-training profile PID`` (when ``demand`` is on)."""
        if not self.demand or self._poller is not None:
            return
        try:
            os.makedirs(demand_dir(), exist_ok=True)
            with open(self._file("listening"), "w", encoding="utf-8") as fh:
                fh.write(str(os.getpid()))
        except OSError as exc:
            self._on_error("profile", exc)
            return
        self._poller = threading.Thread(target=self._poll, name="otel-training-profile-demand", daemon=True)
        self._poller.start()

    def _file(self, what: str) -> str:
        return os.path.join(demand_dir(), f"{os.getpid()}.{what}")

    def _poll(self) -> None:
        path = self._file("request")
        while not self._stop.wait(_POLL_S):
            if not os.path.exists(path):
                continue
            try:
                with open(path, encoding="utf-8") as fh:
                    ask = json.load(fh)
                os.remove(path)
            except (OSError, ValueError):
                continue
            try:
                self._demand(ask)
            except Exception as exc:
                self._on_error("profile", exc)

    def _demand(self, ask: Any) -> None:
        ident = str(ask.get("id", "")) if isinstance(ask, dict) else ""
        ident = "".join(c for c in ident if c.isalnum())[:32] or "request"
        steps = ask.get("steps") if isinstance(ask, dict) else None
        steps = steps if isinstance(steps, int) and 1 <= steps <= MAX_DEMAND_STEPS else self._config.profile_steps
        sequence = self.capture.next_sequence
        self._demands[sequence] = ident  # (before the request: its answer may come quickly)
        if not self.capture.request(Request("demand", 0, steps, {"step": None})):
            self._demands.pop(sequence, None)
            why = self.capture.broken or "another profile is being recorded; ask again in a moment"
            self._write_result(ident, {"error": why})

    def _answer(self, capture: Capture, ident: str) -> None:
        deadline = time.monotonic() + _RESULT_WAIT_S
        while time.monotonic() < deadline and len(self.triggers.facts.get(capture.sequence, ())) < len(capture.steps):
            time.sleep(0.1)
        section = profiles_section(self.triggers, [capture], self.caught, None)
        profile = section.profiles[0].to_dict() if section.profiles else {"error": "no profile was recorded"}
        self._write_result(ident, profile)

    def _write_result(self, ident: str, doc: dict) -> None:
        final = self._file(f"{ident}.result.json")
        tmp = final + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(doc, fh)
            os.replace(tmp, final)
        except OSError as exc:
            self._on_error("profile", exc)

    # -- the run's end ------------------------------------------------------------------
    def stop(self) -> None:
        """End a capture still recording (at the run's end) and stop listening."""
        self._stop.set()
        self.capture.stop()
        if self._poller is not None:
            try:
                os.remove(self._file("listening"))
            except OSError:
                pass

    def join(self, timeout: float) -> None:
        """Wait for the profiles being read, at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for worker in list(self._workers):
            worker.join(max(0.0, deadline - time.monotonic()))
        for capture in self.captures:
            if capture.sequence not in self.caught:
                self.caught[capture.sequence] = "not read before the process ended (OTEL_TRAINING_SHUTDOWN_TIMEOUT)"

    def abandon(self) -> None:
        """In a forked child or a DataLoader worker: listen for nothing."""
        self._stop.set()
        self.capture.due = self.capture.IDLE

    def section(self) -> Profiles:
        return profiles_section(self.triggers, list(self.captures), dict(self.caught), self.capture.broken)
