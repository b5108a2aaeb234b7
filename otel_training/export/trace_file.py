"""``OTEL_TRAINING_TRACE_FILE``: the traced steps as a Chrome trace-event JSON file.

A consumer of ``StepRecord`` batches (pipeline thread) that keeps the records with
a ``trace_reason`` -- the tail-capture sample the spans are made of -- as complete
(``"ph": "X"``) events: one per step, one per phase, nested like the spans, with
the same timestamps. Perfetto UI and chrome://tracing load it.

- ``ts`` is microseconds since ``baseTimeNanoseconds`` (top level), the start of
  the UTC day of the first traced step -- the convention of torch.profiler
  (Kineto) traces: ``baseTimeNanoseconds + 1000 * ts`` is the span's start time
  (epoch ns, ``Pipeline.offset``), and ``dur`` its duration. Epoch microseconds
  themselves would not fit a double to the nanosecond (nested events would
  overlap by rounding); a day's do. ``otel-training trace-merge`` puts rank files
  and torch.profiler traces on one base (docs/report.md).
- ``pid`` is the process (one per rank, named ``rank N (host)``), ``tid`` the
  training thread's native id, as torch.profiler names them.
- Bounded: at most ``MAX_BYTES`` of events; beyond, the oldest traced steps are
  dropped (the first is kept) and counted in ``otherData.dropped_steps``.
- Written whole (to a temporary file, then renamed) at exit, on SIGTERM and at
  ``uninstrument()``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from otel_training import semconv as sc
from otel_training.export.spans import step_attributes
from otel_training.files import check_writable, expand

if TYPE_CHECKING:
    from otel_training.aggregate.between import BetweenRecord
    from otel_training.aggregate.step_record import StepRecord

MAX_BYTES = 32 * 1024 * 1024
DAY_NS = 86_400 * 10**9
_CLOCK = "ts: microseconds since baseTimeNanoseconds (epoch ns, the exported spans' clock)"


def _us(ns: int) -> float:
    return ns / 1000


class TraceFile:
    """Traced steps in, Chrome trace events out (written by ``write``)."""

    def __init__(
        self,
        template: str,
        offset: int,
        info: dict[str, Any],
        thread: Callable[[], int | None] = lambda: None,
        max_bytes: int | None = None,
    ) -> None:
        self.template = template
        self.offset = offset  # perf_counter ns -> epoch ns, the spans' base
        self.info = dict(info)
        self.pid = int(self.info.get("pid") or os.getpid())
        self._thread = thread  # the tracker's training thread (a threading ident)
        self._tids: dict[int, int] = {}  # threading ident -> native thread id
        self._names: dict[int, str] = {}  # native thread id -> thread name
        self.max_bytes = MAX_BYTES if max_bytes is None else max_bytes
        self._steps: deque[str] = deque()  # one JSON fragment per traced step, oldest first
        self._first: str | None = None  # the first traced step is never dropped
        self._bytes = 0
        self.base: int | None = None  # epoch ns that ts counts from (set by the first traced step)
        self.dropped = 0
        self.ok = True
        self._lock = threading.Lock()

    def path(self) -> str:
        return expand(self.template, self.info.get("rank", 0))

    # -- pipeline thread ------------------------------------------------------------
    def add(self, records: Sequence[StepRecord]) -> None:
        traced = [r for r in records if r.trace_reason is not None]
        if not traced:
            return
        tid = self._tid()
        with self._lock:
            if self.base is None:
                self.base = (traced[0].times[0] + self.offset) // DAY_NS * DAY_NS
            for record in traced:
                chunk = ",\n".join(json.dumps(e, separators=(",", ":")) for e in self._events(record, tid))
                if self._first is None:
                    self._first = chunk
                    self._bytes += len(chunk)
                    continue
                self._steps.append(chunk)
                self._bytes += len(chunk)
                while self._bytes > self.max_bytes and self._steps:
                    self._bytes -= len(self._steps.popleft())
                    self.dropped += 1

    def add_between(self, record: BetweenRecord) -> None:
        """Named time between steps (``aggregate.between.BetweenRecord``), when traced:
        one event per named phase, category ``between_steps``, under no step."""
        if not record.traced:
            return
        tid = self._tid()
        with self._lock:
            if self.base is None:
                self.base = (record.start + self.offset) // DAY_NS * DAY_NS
            offset = self.offset - self.base
            events = []
            for p in record.phases:
                args: dict[str, Any] = {sc.ATTR_MODE: sc.MODE_BETWEEN, sc.ATTR_HOST_DURATION: (p.end - p.start) / 1e9}
                if p.up < 0 and record.error is not None:
                    args["error"] = f"{type(record.error).__name__}: {record.error}"
                events.append(
                    {
                        "name": p.name,
                        "cat": sc.MODE_BETWEEN,
                        "ph": "X",
                        "ts": _us(p.start + offset),
                        "dur": _us(p.end - p.start),
                        "pid": self.pid,
                        "tid": tid,
                        "args": args,
                    }
                )
            chunk = ",\n".join(json.dumps(e, separators=(",", ":")) for e in events)
            if self._first is None:
                self._first = chunk
                self._bytes += len(chunk)
                return
            self._steps.append(chunk)
            self._bytes += len(chunk)
            while self._bytes > self.max_bytes and self._steps:
                self._bytes -= len(self._steps.popleft())
                self.dropped += 1

    def _tid(self) -> int:
        ident = self._thread()
        if ident is None or ident < 0:
            ident = threading.main_thread().ident or 0
        tid = self._tids.get(ident)
        if tid is None:
            tid = ident
            for t in threading.enumerate():
                if t.ident == ident and t.native_id is not None:
                    tid = t.native_id
                    self._names[tid] = t.name
            self._tids[ident] = tid
        return tid

    def _events(self, record: StepRecord, tid: int) -> list[dict]:
        offset, times, host, pid = self.offset - (self.base or 0), record.times, record.host, self.pid
        args = step_attributes(record)
        if record.error is not None:
            args["error"] = f"{type(record.error).__name__}: {record.error}"
        start = times[0] + offset
        events: list[dict[str, Any]] = [
            {
                "name": sc.SPAN_STEP,
                "cat": record.mode,
                "ph": "X",
                "ts": _us(start),
                "dur": _us(times[-1] - times[0]),
                "pid": pid,
                "tid": tid,
                "args": args,
            }
        ]
        device, idle = record.device, record.idle_by_phase
        for i, p in enumerate(record.layout.phases):
            a: dict[str, Any] = {sc.ATTR_HOST_DURATION: (host[p.end] - host[p.start]) / 1e9}
            if device is not None:
                a[sc.ATTR_DEVICE_DURATION] = (times[p.end] - times[p.start]) / 1e9
                if idle is not None and i in idle:
                    a[sc.ATTR_GPU_IDLE] = idle[i] / 1e9
            events.append(
                {
                    "name": p.name,
                    "cat": "phase",
                    "ph": "X",
                    "ts": _us(times[p.start] + offset),
                    "dur": _us(times[p.end] - times[p.start]),
                    "pid": pid,
                    "tid": tid,
                    "args": a,
                }
            )
        # Parents first at equal start times, so viewers nest zero-length phases right.
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        return events

    # -- exit ---------------------------------------------------------------------------
    def _metadata(self) -> list[dict]:
        rank, host = self.info.get("rank"), self.info.get("host")
        name = f"rank {rank} ({host})" if rank is not None else f"otel-training ({host})"
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": name}},
            {"name": "process_sort_index", "ph": "M", "pid": self.pid, "tid": 0, "args": {"sort_index": rank or 0}},
        ]
        for tid in self._tids.values():
            label = self._names.get(tid, "training thread")
            meta.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self.pid,
                    "tid": tid,
                    "args": {"name": f"steps ({label})"},
                }
            )
        return meta

    def text(self) -> str | None:
        """The whole file, or None when no step was traced."""
        with self._lock:
            if self._first is None:
                return None
            chunks = [self._first, *self._steps]
            dropped = self.dropped
        other = {
            "producer": "otel-training",
            "clock": _CLOCK,
            "dropped_steps": dropped,
            **{k: v for k, v in self.info.items() if v is not None},
        }
        meta = ",\n".join(json.dumps(e, separators=(",", ":")) for e in self._metadata())
        return (
            '{"traceEvents":[\n'
            + meta
            + ",\n"
            + ",\n".join(chunks)
            + f'\n],\n"baseTimeNanoseconds":{self.base},\n"displayTimeUnit":"ms",\n"otherData":'
            + json.dumps(other)
            + "}\n"
        )

    def check(self) -> None:
        """Find out at start, not after the run, that the file cannot be written."""
        path = self.path()
        try:
            check_writable(path)
        except OSError as exc:
            self.ok = False
            self._error(exc)

    def write(self) -> str | None:
        """Write the file (atomically); its path, or None when nothing was written."""
        if not self.ok:
            return None
        text = self.text()
        if text is None:
            return None
        path = self.path()
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
        except OSError as exc:
            self.ok = False
            self._error(exc)
            return None
        return path

    def _error(self, exc: OSError) -> None:
        reason = exc.strerror or type(exc).__name__
        print(
            f"otel-training: OTEL_TRAINING_TRACE_FILE={self.template!r} cannot be written ({reason}): "
            "use a writable file path (no trace file for this run; training continues)",
            file=sys.stderr,
            flush=True,
        )
