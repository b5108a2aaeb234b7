"""The pipeline: finished step timelines in, spans, metrics and summary out.

Runs on its own daemon thread so the training thread only appends to a deque.
The deque is bounded: if we fall behind, steps are dropped and counted, never
waited for.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Tuple

from opentelemetry import trace

from otel_training import semconv as sc
from otel_training.attribution import idle_between, synchronized_marks
from otel_training.capture import TailCapture
from otel_training.emit.metrics import StepMetrics
from otel_training.emit.spans import emit_step_spans
from otel_training.summary import RunSummary

_MAX_PENDING = 4096
_POLL_S = 0.02
_SLICE_NS = 200_000  # the longest we hold the GIL before handing it back


class Pipeline:
    def __init__(self, *, tracer, metrics: StepMetrics, capture: TailCapture, summary: RunSummary,
                 timer: Any, telemetry: Any, span_attributes: dict,
                 on_step_done: Optional[Callable[[Any], None]] = None) -> None:
        self._tracer = tracer
        self._metrics = metrics
        self._capture = capture
        self.summary = summary
        self._timer = timer
        self._telemetry = telemetry
        self._span_attrs = dict(span_attributes)
        self._queue: deque = deque()
        self._wake = threading.Event()
        self._stop = False
        self._busy = False
        self._thread: Optional[threading.Thread] = None
        # perf_counter ns -> epoch ns, fixed once so spans stay consistent.
        self.offset = time.time_ns() - time.perf_counter_ns()
        self.on_step_done = on_step_done

    # -- training thread ------------------------------------------------------------
    def submit(self, step) -> None:
        if len(self._queue) >= _MAX_PENDING:
            self._telemetry.steps_dropped += 1
            self._timer.release(step.tokens)
            return
        self._queue.append(step)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="otel-training-pipeline", daemon=True)
        self._thread.start()

    def flush(self, timeout: float) -> bool:
        """Process everything queued so far, waiting at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        if self._thread is None or not self._thread.is_alive():
            self._drain(deadline)
            return not self._queue
        self._wake.set()
        while (self._queue or self._busy) and time.monotonic() < deadline:
            time.sleep(0.002)
        return not self._queue

    def stop(self, timeout: float) -> None:
        self.flush(timeout)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(max(0.0, timeout))

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(_POLL_S)
            self._wake.clear()
            self._drain(None)

    def _drain(self, deadline: Optional[float]) -> None:
        queue = self._queue
        if queue:
            try:
                self._drain_steps(queue, deadline)
            finally:
                try:
                    self._metrics.flush()
                except Exception as exc:
                    self._telemetry.internal_error("pipeline", exc)

    def _drain_steps(self, queue: deque, deadline: Optional[float]) -> None:
        clock = time.perf_counter_ns
        slice_end = clock() + _SLICE_NS
        while queue:
            if deadline is not None and time.monotonic() > deadline:
                return
            self._busy = True
            step = queue.popleft()
            try:
                self.process(step)
            except Exception as exc:  # our bug: count it, keep going
                self._telemetry.internal_error("pipeline", exc)
            finally:
                self._busy = False
            # Hand the GIL back every time slice: the training thread never waits a
            # whole switch interval (5 ms) for us, and short steps do not pay a GIL
            # hand-over each.
            if clock() >= slice_end:
                time.sleep(0)
                slice_end = clock() + _SLICE_NS

    # -- per step ---------------------------------------------------------------------
    def process(self, step) -> None:
        host = step.marks
        if len(host) < 2:
            return
        device = self._timer.resolve(host, step.tokens) if self._timer.observes_device else None
        times = synchronized_marks(host, device) if device is not None else host
        mode = step.mode
        batch_name = sc.PHASE_TRAIN_BATCH if mode == sc.MODE_TRAIN else sc.PHASE_EVAL_BATCH

        phases_ns: Dict[Tuple[str, str], int] = {}
        top: List[Tuple[int, int, int]] = []  # (start mark, end mark, record index)
        for i, rec in enumerate(step.phases):
            if rec.end < 0:
                continue
            name = batch_name if rec.name == "batch" else rec.name
            parent = batch_name if rec.parent == "batch" else rec.parent
            key = (name, parent)
            phases_ns[key] = phases_ns.get(key, 0) + (times[rec.end] - times[rec.start])
            if rec.up is None:
                top.append((rec.start, rec.end, i))
        top.sort()
        step_ns = times[-1] - times[0]
        covered = 0
        for start, end, _ in top:
            covered += times[end] - times[start]
        untracked = step_ns - covered
        if untracked > 0:
            phases_ns[(sc.PHASE_UNTRACKED, sc.SPAN_STEP)] = untracked

        idle_ns: Optional[Dict[str, int]] = None
        idle_by_rec: Optional[Dict[int, int]] = None
        if device is not None:
            idle_ns, idle_by_rec = self._attribute_idle(step, host, device, top)

        # The events timer switches on lazily, when the program starts using CUDA.
        timing = self._timer.mode if device is not None else "off"
        self.summary.timing = timing
        self.summary.add(mode, times[0], times[-1], phases_ns, idle_ns, step.batch_size)

        reason = self._capture.decide(mode, step_ns, host[-1], step.error is not None)
        context = None
        if reason is not None:
            attrs = dict(self._span_attrs)
            attrs[sc.ATTR_STEP] = step.index
            attrs[sc.ATTR_MODE] = mode
            attrs[sc.ATTR_UNTRACKED] = max(untracked, 0) / 1e9
            attrs[sc.ATTR_TRACE_REASON] = reason
            attrs[sc.ATTR_TIMING] = timing
            if step.epoch is not None:
                attrs[sc.ATTR_EPOCH] = step.epoch
            if step.batch_size is not None:
                attrs[sc.ATTR_BATCH_SIZE] = step.batch_size
            if step.extra:
                attrs.update(step.extra)
            root = emit_step_spans(self._tracer, step, batch_name, times, host, device, self.offset,
                                   attrs, idle_by_rec)
            self._telemetry.spans_created += 1 + sum(1 for r in step.phases if r.end >= 0)
            context = trace.set_span_in_context(root)

        idle_s = {k: v / 1e9 for k, v in idle_ns.items()} if idle_ns else None
        self._metrics.record(mode, step_ns / 1e9, phases_ns, idle_s, step.batch_size, context,
                             self.offset + times[-1])
        if self.on_step_done is not None:
            self.on_step_done(step)

    @staticmethod
    def _attribute_idle(step, host, device, top) -> tuple:
        """GPU idle per top-level phase (and per untracked gap)."""
        idle: Dict[str, int] = {}
        by_rec: Dict[int, int] = {}
        prev_end = 0
        for start, end, i in top:
            if start > prev_end:  # an untracked gap
                gap = idle_between(host, device, prev_end, start)
                if gap:
                    idle[sc.PHASE_UNTRACKED] = idle.get(sc.PHASE_UNTRACKED, 0) + gap
            ns = idle_between(host, device, start, end)
            by_rec[i] = ns
            if ns:
                rec = step.phases[i]
                name = rec.name if rec.name != "batch" else (
                    sc.PHASE_TRAIN_BATCH if step.mode == sc.MODE_TRAIN else sc.PHASE_EVAL_BATCH)
                idle[name] = idle.get(name, 0) + ns
            prev_end = max(prev_end, end)
        last = len(host) - 1
        if last > prev_end:
            gap = idle_between(host, device, prev_end, last)
            if gap:
                idle[sc.PHASE_UNTRACKED] = idle.get(sc.PHASE_UNTRACKED, 0) + gap
        return idle, by_rec
