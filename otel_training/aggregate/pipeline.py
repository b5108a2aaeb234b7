"""The pipeline: finished step timelines in; records out to the consumers.

The training thread only appends to a bounded deque (``submit``); if we fall behind,
steps are dropped and counted, never waited for. On its own daemon thread the
pipeline resolves each timeline once into an immutable ``StepRecord``
(``step_record.py``) and hands batches of records, one way, to the consumers in a fixed
order: coverage, run summary, time series, spans, the trace file when one is asked
for, then metrics (which take the traced steps' span contexts for exemplars). No
consumer calls back into the pipeline.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from otel_training.aggregate.between import BetweenRecord, resolve_between
from otel_training.aggregate.coverage import Coverage
from otel_training.aggregate.sampling import TailCapture
from otel_training.aggregate.step_record import Resolver, SentLayouts, StepRecord
from otel_training.aggregate.summary import RunSummary
from otel_training.aggregate.timeseries import TimeSeries
from otel_training.record.profile_capture import IDLE, ProfileCapture
from otel_training.record.timeline import BetweenSteps, StepTimeline
from otel_training.timing.device import DeviceTimer

if TYPE_CHECKING:
    from opentelemetry.context import Context

_MAX_PENDING = 4096
# Steps are processed in batches, every _POLL_S: a batch runs with warmer caches and
# each consumer's per-batch work is paid once per drain. Every microsecond of our
# CPU here costs the training thread about as much in GIL waits, so bigger batches
# pay (docs/performance.md). Where metrics are exported more often than twice
# _POLL_S, the thread drains twice per export, so each export carries its steps.
# A queue reaching _WAKE_AT (very short steps) wakes the thread early, far from
# _MAX_PENDING.
_POLL_S = 0.5
_MIN_POLL_S = 0.01
_WAKE_AT = 1024
_SLICE_NS = 200_000  # the longest we resolve steps before handing the GIL back
_MAX_BATCH = 1024  # records delivered at once at most (a backlog is delivered in parts)


class Consumer(Protocol):
    """Takes batches of finished steps (in step order, on the pipeline thread)."""

    def add(self, records: Sequence[StepRecord]) -> None: ...


class SpanConsumer(Protocol):
    """Emits the traced steps' spans; per traced record (``id``), the context that
    holds its step span (the metrics' exemplars)."""

    def add(self, records: Sequence[StepRecord]) -> dict[int, Context]: ...
    def add_between(self, record: BetweenRecord) -> None: ...


class MetricsConsumer(Protocol):
    """Records the steps' metrics; ``flush`` after each drain adds the counters."""

    def add(self, records: Sequence[StepRecord], contexts: dict[int, Context]) -> None: ...
    def add_between(self, record: BetweenRecord) -> None: ...
    def flush(self) -> None: ...


class Health(Protocol):
    """Where the pipeline counts what it dropped and the errors it contained."""

    def drop_steps(self, count: int) -> None: ...
    def internal_error(self, component: str, exc: BaseException | None = None) -> None: ...


class _NoProfiles:
    """Profiles off: never due."""

    due = IDLE

    def fire(self, step: StepTimeline) -> None:  # pragma: no cover - never due
        pass


class Pipeline:
    """Owns the step queue and the thread that drains it."""

    def __init__(
        self,
        *,
        spans: SpanConsumer,
        metrics: MetricsConsumer,
        capture: TailCapture,
        summary: RunSummary,
        timer: DeviceTimer,
        telemetry: Health,
        offset: int,
        trace_file: Consumer | None = None,
        timeseries: bool = True,
        consumers: Sequence[Consumer] = (),
        export_interval_s: float | None = None,
        profiles: ProfileCapture | None = None,
    ) -> None:
        self.summary = summary
        self.consumers = tuple(consumers)  # more record consumers (memory trend, throughput), after the summary
        self.coverage = Coverage()  # (steps arrive in time order)
        # The run over time, for the summary file's charts: kept only when a summary is asked for.
        self.timeseries = TimeSeries(offset) if timeseries else None
        self._trace_file = trace_file  # OTEL_TRAINING_TRACE_FILE: traced steps as Chrome trace events
        self._resolver = Resolver(timer, capture)
        self._capture = capture
        self._spans = spans
        self._metrics = metrics
        self._timer = timer
        self._telemetry = telemetry
        self.offset = offset  # perf_counter ns -> epoch ns, fixed once so spans stay consistent
        self._queue: deque = deque()
        self._wake = threading.Event()
        self._drained = threading.Event()  # set after each drain (flush waits on it)
        self._stop = False
        self._busy = False
        self._thread: threading.Thread | None = None
        self.poll_s = drain_interval(export_interval_s)
        self._shed = SentLayouts().shed  # (training thread)
        # Profiles (record/profile_capture.py): the steps handed on start and stop them.
        self._profiles: ProfileCapture | _NoProfiles = profiles if profiles is not None else _NoProfiles()

    # -- training thread ------------------------------------------------------------
    def submit(self, step: StepTimeline) -> None:
        if step.train_before >= self._profiles.due:  # (a capture asked for, or recording)
            self._profiles.fire(step)
        queue = self._queue
        pending = len(queue)
        if pending >= _MAX_PENDING:
            self._telemetry.drop_steps(1)
            self._timer.release(step.tokens)
            return
        try:
            self._shed(step)
        except Exception as exc:  # our bug: the step goes as it is
            self._telemetry.internal_error("pipeline", exc)
        queue.append(step)
        if pending == _WAKE_AT:
            self._wake.set()

    def submit_between(self, group: BetweenSteps) -> None:
        """Named time between steps (the assembler hands it on in time order with the
        steps): queued with them."""
        if len(self._queue) >= _MAX_PENDING:
            self._telemetry.drop_steps(1)
            return
        self._queue.append(group)

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

    def abandon(self, wake: bool) -> None:
        """In a forked child or a DataLoader worker: forget the queued steps and let the
        thread leave (``wake``: it runs in this process, a spawned worker's)."""
        self._queue.clear()
        self._stop = True
        if wake:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            self._drain(None)

    def _drain(self, deadline: float | None) -> None:
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

    def _drain_steps(self, queue: deque, deadline: float | None) -> None:
        clock = time.perf_counter_ns
        resolve = self._resolver.resolve
        batch: list[StepRecord] = []
        while queue:
            if deadline is not None and time.monotonic() > deadline:
                break
            # Hand the GIL back every time slice: the training thread never waits a
            # whole switch interval (5 ms) for us, and short steps do not pay a GIL
            # hand-over each. The records wait for one delivery per drain: each
            # consumer's per-batch work is then paid once (docs/performance.md).
            slice_end = clock() + _SLICE_NS
            while queue:
                step = queue.popleft()
                try:
                    record = resolve(step)
                except Exception as exc:  # our bug: count it, keep going
                    self._telemetry.internal_error("pipeline", exc)
                    continue
                if record is not None:
                    batch.append(record)
                elif step.__class__ is BetweenSteps:  # (it has no marks: no step record)
                    # Named time between steps: the steps before it go first.
                    self._deliver(batch)
                    batch = []
                    self._deliver_between(step)
                if clock() >= slice_end:
                    break
            if len(batch) >= _MAX_BATCH:
                self._deliver(batch)
                batch = []
            if queue:
                time.sleep(0)
        self._deliver(batch)

    def _deliver(self, batch: list[StepRecord]) -> None:
        """Hand a batch to each consumer; one that fails loses only its own share."""
        if not batch:
            return
        telemetry = self._telemetry
        for consumer in (self.coverage, self.summary, self.timeseries, *self.consumers):
            if consumer is None:
                continue
            try:
                consumer.add(batch)
            except Exception as exc:
                telemetry.internal_error("pipeline", exc)
        contexts: dict[int, Context] = {}
        try:
            contexts = self._spans.add(batch)
        except Exception as exc:
            telemetry.internal_error("pipeline", exc)
        if self._trace_file is not None:
            try:
                self._trace_file.add(batch)
            except Exception as exc:
                telemetry.internal_error("trace_file", exc)
        try:
            self._metrics.add(batch, contexts)
        except Exception as exc:
            telemetry.internal_error("pipeline", exc)

    def _deliver_between(self, group: BetweenSteps) -> None:
        """Named time between steps to the consumers that read it."""
        telemetry = self._telemetry
        try:
            record = resolve_between(group, self._capture)
        except Exception as exc:  # our bug: count it, keep going
            telemetry.internal_error("pipeline", exc)
            return
        if record is None:
            return
        for consumer in (self.coverage, self._spans, self._trace_file, self._metrics, *self.consumers):
            add = getattr(consumer, "add_between", None)
            if add is None:
                continue
            try:
                add(record)
            except Exception as exc:
                telemetry.internal_error("pipeline", exc)


def drain_interval(export_interval_s: float | None) -> float:
    """Seconds between drains: ``_POLL_S``, or half the shortest periodic metric
    export interval where that is shorter (None: no periodic export)."""
    if export_interval_s is None or not export_interval_s > 0:
        return _POLL_S
    return max(_MIN_POLL_S, min(_POLL_S, export_interval_s / 2))
