"""The pipeline: finished step timelines in, spans, metrics and summary out.

Runs on its own daemon thread so the training thread only appends to a deque.
The deque is bounded: if we fall behind, steps are dropped and counted, never
waited for. Untraced steps timed by host clocks are added by shape, in bulk
(``shapes.py``); traced and GPU-timed steps one by one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Dict, List, Optional, Tuple

from opentelemetry import trace

from otel_training import semconv as sc
from otel_training.attribution import idle_between, synchronized_marks
from otel_training.capture import TailCapture
from otel_training.coverage import Coverage
from otel_training.emit.metrics import StepMetrics
from otel_training.emit.spans import emit_step_spans
from otel_training.shapes import UNTRACKED_KEY, Shapes
from otel_training.summary import RunSummary

_MAX_PENDING = 4096
# Steps are processed in batches, every _POLL_S: a batch runs with warm caches and
# the two threads contend for the GIL (and for shared cache lines) rarely. At 1 ms
# steps this halved the pipeline's cost against a 20 ms poll. A queue reaching
# _WAKE_AT (very short steps) wakes the thread early, far from _MAX_PENDING.
_POLL_S = 0.1
_WAKE_AT = 1024
_SLICE_NS = 200_000  # the longest we hold the GIL before handing it back


_UNSET = object()


class _PhaseSlot:
    """One (mode, phase, parent): its run totals, its metric handle, this step's time."""

    __slots__ = ("totals", "handle", "queue", "ns", "seen")

    def __init__(self, totals: list, handle: Any, queue: Optional[list]) -> None:
        self.totals = totals  # the summary's live [total ns, steps]
        self.handle = handle  # StepMetrics.phase_handle
        self.queue = queue  # StepMetrics.queue_for(handle): untraced steps' seconds go here
        self.ns = 0
        self.seen = 0  # the step (sequence number) ``ns`` belongs to

    def add(self, ns: int, seq: int, touched: list) -> None:
        """``ns`` more in step ``seq``; the slot joins ``touched`` once per step."""
        totals = self.totals
        totals[0] += ns
        if self.seen != seq:
            self.seen = seq
            self.ns = ns
            totals[1] += 1
            touched.append(self)
        else:
            self.ns += ns


class Pipeline:
    def __init__(self, *, tracer, metrics: StepMetrics, capture: TailCapture, summary: RunSummary,
                 timer: Any, telemetry: Any, span_attributes: dict) -> None:
        self._tracer = tracer
        self._metrics = metrics
        self._capture = capture
        self.summary = summary
        self._timer = timer
        self._telemetry = telemetry
        self._span_attrs = dict(span_attributes)
        self._queue: deque = deque()
        self._wake = threading.Event()
        self._drained = threading.Event()  # set after each drain (flush waits on it)
        self._stop = False
        self._busy = False
        self._thread: Optional[threading.Thread] = None
        # perf_counter ns -> epoch ns, fixed once so spans stay consistent.
        self.offset = time.time_ns() - time.perf_counter_ns()
        self._slots: Dict[str, Dict[Tuple[str, str], _PhaseSlot]] = {}
        self._seq = 0
        self.coverage = Coverage()  # (steps arrive in time order)
        self._step_queues: Dict[str, Optional[list]] = {}
        # Binned histograms: untraced host-timed steps are added by shape, in bulk.
        self._shapes = Shapes(self._slot, self._step_queue, self._add_steps) if metrics.fast else None

    # -- training thread ------------------------------------------------------------
    def submit(self, step) -> None:
        queue = self._queue
        pending = len(queue)
        if pending >= _MAX_PENDING:
            self._telemetry.steps_dropped += 1
            self._timer.release(step.tokens)
            return
        queue.append(step)
        if pending == _WAKE_AT:
            self._wake.set()

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
            self._drained.wait(min(0.01, max(0.0, deadline - time.monotonic())))
            self._drained.clear()
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
        if not queue:
            return
        # Busy until the counters are added too: flush() returns only then.
        self._busy = True
        try:
            self._drain_steps(queue, deadline)
        finally:
            try:
                self._metrics.flush()
            except Exception as exc:
                self._telemetry.internal_error("pipeline", exc)
            finally:
                self._busy = False
                self._drained.set()

    def _drain_steps(self, queue: deque, deadline: Optional[float]) -> None:
        clock = time.perf_counter_ns
        slice_end = clock() + _SLICE_NS
        while queue:
            if deadline is not None and time.monotonic() > deadline:
                return
            step = queue.popleft()
            try:
                self.process(step)
            except Exception as exc:  # our bug: count it, keep going
                self._telemetry.internal_error("pipeline", exc)
            # Hand the GIL back every time slice: the training thread never waits a
            # whole switch interval (5 ms) for us, and short steps do not pay a GIL
            # hand-over each.
            if clock() >= slice_end:
                self._add_shapes()
                time.sleep(0)
                slice_end = clock() + _SLICE_NS
        self._add_shapes()

    def _add_shapes(self) -> None:
        shapes = self._shapes
        if shapes is not None:
            try:
                shapes.flush()
            except Exception as exc:  # our bug: count it, keep going
                self._telemetry.internal_error("pipeline", exc)
                self._telemetry.steps_dropped += shapes.drop()  # counted, not retried

    # -- per step ---------------------------------------------------------------------
    def process(self, step) -> None:
        host = step.marks
        if len(host) < 2:
            return
        device = self._timer.resolve(host, step.tokens) if self._timer.observes_device else None
        times = synchronized_marks(host, device) if device is not None else host
        if step.saw_backward or step.saw_optimizer:
            mode = sc.MODE_TRAIN
            micro = step.microbatches or (step.backwards + step.closure_backward) or 1
        else:
            mode, micro = sc.MODE_EVAL, 0
        self.coverage.add(step.index, host[0], host[-1], micro)
        step_ns = times[-1] - times[0]
        reason = self._capture.decide(mode, step_ns, host[-1], step.error is not None)
        if reason is None and device is None and self._shapes is not None and not step.skipped:
            # The usual step: queued by shape, its phases added in bulk (see shapes.py).
            try:
                queued = self._shapes.add(mode, step.phases, times, step.batch_size, micro)
            except Exception as exc:  # our bug: the step goes the per-step way
                self._telemetry.internal_error("pipeline", exc)
                queued = False
            if queued:
                return
        summary = self.summary
        slots = self._slots.get(mode)
        if slots is None:
            slots = self._slots[mode] = {}

        # One pass: each phase's time this step, summed per (name, parent) slot;
        # the slot's run totals count it once per step.
        self._seq = seq = self._seq + 1
        touched: List[_PhaseSlot] = []
        covered = 0
        phases = step.phases
        for rec in phases:
            end = rec.end
            if end < 0:
                continue
            ns = times[end] - times[rec.start]
            if rec.up is None:
                covered += ns  # top-level phases never overlap
            slot = slots.get((rec.name, rec.parent))
            if slot is None:
                slot = self._slot(mode, rec.name, rec.parent)
            slot.add(ns, seq, touched)
        untracked = step_ns - covered
        if untracked > 0:
            self._slot(mode, *UNTRACKED_KEY).add(untracked, seq, touched)

        idle_ns: Optional[Dict[str, int]] = None
        idle_by_rec: Optional[Dict[int, int]] = None
        if device is not None:
            top = sorted((rec.start, rec.end, i) for i, rec in enumerate(phases)
                         if rec.up is None and rec.end >= 0)
            idle_ns, idle_by_rec = self._attribute_idle(step, host, device, top)

        # The events timer switches on lazily, when the program starts using CUDA.
        timing = self._timer.mode if device is not None else "off"
        summary.timing = timing
        summary.add_step(mode, times[0], times[-1], idle_ns, step.batch_size, micro, step.skipped)

        context = None
        if reason is not None:
            context = self._trace(step, mode, times, host, device, untracked, reason, timing, idle_by_rec, micro)

        step_queue = self._step_queue(mode)
        if context is None and idle_ns is None and step_queue is not None:
            # An untraced step not queued by shape: its values are queued for
            # binning in bulk all the same.
            for slot in touched:
                slot.queue.append(slot.ns / 1e9)
            step_queue.append(step_ns / 1e9)
            self._metrics.count(mode, 1, step.batch_size or 0, microbatches=micro, skipped=step.skipped)
        else:
            idle_s = {k: v / 1e9 for k, v in idle_ns.items()} if idle_ns else None
            self._metrics.record_phases(mode, step_ns / 1e9, [(slot.handle, slot.ns / 1e9) for slot in touched],
                                        idle_s, step.batch_size, context, self.offset + times[-1],
                                        micro, step.skipped)

    def _add_steps(self, mode: str, first_start: int, last_end: int, step_ns: List[int], samples: int,
                   microbatches: int) -> None:
        """Steps added by shape: their summary totals and counters."""
        self.summary.add_steps(mode, first_start, last_end, step_ns, samples, microbatches)
        self._metrics.count(mode, len(step_ns), samples, microbatches=microbatches)

    def _step_queue(self, mode: str) -> Optional[list]:
        """Where untraced step durations of ``mode`` are queued (None: the SDK records)."""
        queue = self._step_queues.get(mode, _UNSET)
        if queue is _UNSET:
            queue = self._step_queues[mode] = self._metrics.step_queue(mode)
        return queue

    def _slot(self, mode: str, name: str, parent: str) -> "_PhaseSlot":
        """The slot of phase (name, parent) in ``mode``, made on first use."""
        slots = self._slots.get(mode)
        if slots is None:
            slots = self._slots[mode] = {}
        slot = slots.get((name, parent))
        if slot is None:
            batch = sc.PHASE_TRAIN_BATCH if mode == sc.MODE_TRAIN else sc.PHASE_EVAL_BATCH
            key = (batch if name == "batch" else name, batch if parent == "batch" else parent)
            handle = self._metrics.phase_handle(mode, key)
            slot = slots[(name, parent)] = _PhaseSlot(self.summary.phase_totals(mode, key), handle,
                                                      self._metrics.queue_for(handle))
        return slot

    def _trace(self, step, mode: str, times, host, device, untracked: int, reason: str, timing: str,
               idle_by_rec, microbatches: int) -> Any:
        """Emit the step's spans; the context holding its root span."""
        batch_name = sc.PHASE_TRAIN_BATCH if mode == sc.MODE_TRAIN else sc.PHASE_EVAL_BATCH
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
        if microbatches:
            attrs[sc.ATTR_MICROBATCHES] = microbatches
        if step.skipped:
            attrs[sc.ATTR_UPDATE_SKIPPED] = True
        root = emit_step_spans(self._tracer, step, batch_name, times, host, device, self.offset,
                               attrs, idle_by_rec)
        self._telemetry.spans_created += 1 + sum(1 for r in step.phases if r.end >= 0)
        return trace.set_span_in_context(root)

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
