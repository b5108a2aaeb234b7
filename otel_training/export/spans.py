"""Spans of traced steps, built after the step from its record, with explicit timestamps."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from otel_training import semconv as sc
from otel_training.export import sdk

if TYPE_CHECKING:
    from otel_training.aggregate.between import BetweenRecord
    from otel_training.aggregate.step_record import StepRecord

_ROOT_CONTEXT = Context()
_INHERITED = (sc.ATTR_RANK, sc.ATTR_LOCAL_RANK, sc.ATTR_WORLD_SIZE)

RandomIdGenerator: Any
try:
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
except ImportError:  # pragma: no cover - API only
    RandomIdGenerator = None


if RandomIdGenerator is not None:

    class _PrivateRandomIdGenerator(RandomIdGenerator):
        """The SDK's random ids, from a generator of our own: training scripts reseed
        the global ``random`` (and torch.compile restores its state), which would
        repeat the SDK's default ids -- traces merged, the same ids on every rank. A
        forked child reseeds at its first id (no fork handler: nothing to remove)."""

        def __init__(self) -> None:
            self._random = random.Random()
            self._pid = os.getpid()

        def _rng(self) -> random.Random:
            if os.getpid() != self._pid:  # a forked child: not a copy of the parent's ids
                self._pid = os.getpid()
                self._random.seed()
            return self._random

        def generate_span_id(self) -> int:
            rng = self._rng()
            span_id = rng.getrandbits(64)
            while span_id == trace.INVALID_SPAN_ID:
                span_id = rng.getrandbits(64)
            return span_id

        def generate_trace_id(self) -> int:
            rng = self._rng()
            trace_id = rng.getrandbits(128)
            while trace_id == trace.INVALID_TRACE_ID:
                trace_id = rng.getrandbits(128)
            return trace_id

    _PRIVATE_IDS = _PrivateRandomIdGenerator()


def _private_ids(tracer: Tracer) -> None:
    """Give our own tracer (scope ``otel_training``) private random ids; a custom
    id generator configured by the user is kept."""
    if RandomIdGenerator is not None:
        sdk.use_id_generator(tracer, _PRIVATE_IDS, RandomIdGenerator)


def step_attributes(record: StepRecord) -> dict[str, Any]:
    """The step's own attributes (docs/telemetry.md), for its span and its trace event."""
    attrs: dict[str, Any] = {
        sc.ATTR_STEP: record.number,
        sc.ATTR_MODE: record.mode,
        sc.ATTR_UNTRACKED: max(record.untracked_ns, 0) / 1e9,
        sc.ATTR_TRACE_REASON: record.trace_reason,
        sc.ATTR_TIMING: record.timing,
    }
    if record.epoch is not None:
        attrs[sc.ATTR_EPOCH] = record.epoch
    if record.batch_size is not None:
        attrs[sc.ATTR_BATCH_SIZE] = record.batch_size
    if record.tokens is not None:
        attrs[sc.ATTR_TOKENS] = record.tokens
    if record.microbatches:
        attrs[sc.ATTR_MICROBATCHES] = record.microbatches
    if record.skipped:
        attrs[sc.ATTR_UPDATE_SKIPPED] = True
    return attrs


class StepSpans:
    """The span consumer: a ``step`` span and one child per phase for each traced
    record (one with a ``trace_reason``), with explicit timestamps."""

    def __init__(
        self,
        tracer: Tracer,
        attributes: dict[str, Any],
        offset: int,
        profiled: Callable[[], dict[int, tuple[str, str]]] | None = None,
    ) -> None:
        self._tracer = tracer
        # The batch's records a profile recorded (id -> (file, trigger)): traced, with an event.
        self._profiled = profiled
        self._attrs = dict(attributes)
        self._inherited = {k: self._attrs[k] for k in _INHERITED if k in self._attrs}
        self._offset = offset  # perf_counter ns -> epoch ns
        _private_ids(tracer)

    def rebind(self, attributes: dict[str, Any]) -> None:
        """Put ``attributes`` (the rank, once known) on the spans from now on."""
        attrs = dict(attributes)
        self._inherited = {k: attrs[k] for k in _INHERITED if k in attrs}
        self._attrs = attrs

    def add(self, records: Sequence[StepRecord]) -> dict[int, Context]:
        """Emit the traced records' spans; per traced record (by ``id``), the context
        holding its root span (for exemplars)."""
        out: dict[int, Context] = {}
        marked = self._profiled() if self._profiled is not None else None
        for record in records:
            if record.trace_reason is not None:
                out[id(record)] = trace.set_span_in_context(self._emit(record, marked))
            elif marked and id(record) in marked:
                out[id(record)] = trace.set_span_in_context(self._emit(record, marked, sc.TRACE_REASON_PROFILE))
        return out

    def add_between(self, record: BetweenRecord) -> None:
        """Named time between steps (``aggregate.between.BetweenRecord``), when traced:
        a root span of its own (under no step), its nested named phases under it."""
        if not record.traced:
            return
        tracer, offset = self._tracer, self._offset
        spans: list[Span] = []
        for p in record.phases:
            attrs = dict(self._attrs) if p.up < 0 else dict(self._inherited)
            attrs[sc.ATTR_MODE] = sc.MODE_BETWEEN
            attrs[sc.ATTR_HOST_DURATION] = (p.end - p.start) / 1e9
            context = _ROOT_CONTEXT if p.up < 0 else trace.set_span_in_context(spans[p.up])
            spans.append(tracer.start_span(p.name, context=context, start_time=p.start + offset, attributes=attrs))
        error = record.error
        if error is not None:
            spans[0].set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            spans[0].record_exception(error)
        for span, p in reversed(list(zip(spans, record.phases))):
            span.end(end_time=p.end + offset)

    def _emit(self, record: StepRecord, marked: dict | None = None, reason: str | None = None) -> Span:
        attrs = dict(self._attrs)
        attrs.update(step_attributes(record))
        if reason is not None:
            attrs[sc.ATTR_TRACE_REASON] = reason
        tracer, offset, times, host = self._tracer, self._offset, record.times, record.host
        device, idle = record.device, record.idle_by_phase
        root = tracer.start_span(sc.SPAN_STEP, context=_ROOT_CONTEXT, start_time=times[0] + offset, attributes=attrs)
        root_ctx = trace.set_span_in_context(root)
        spans: list[Span] = []
        contexts: dict[int, Context] = {}  # made only for phases that have children
        for i, p in enumerate(record.layout.phases):
            parent_ctx = root_ctx
            if p.parent >= 0:
                known = contexts.get(p.parent)
                if known is None:
                    known = contexts[p.parent] = trace.set_span_in_context(spans[p.parent])
                parent_ctx = known
            a = dict(self._inherited)  # rank attributes go on every span
            a[sc.ATTR_HOST_DURATION] = (host[p.end] - host[p.start]) / 1e9
            if device is not None:
                a[sc.ATTR_DEVICE_DURATION] = (times[p.end] - times[p.start]) / 1e9
                if idle is not None and i in idle:
                    a[sc.ATTR_GPU_IDLE] = idle[i] / 1e9
            span = tracer.start_span(p.name, context=parent_ctx, start_time=times[p.start] + offset, attributes=a)
            span.end(end_time=times[p.end] + offset)
            spans.append(span)
        error = record.error
        if error is not None:
            root.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            root.record_exception(error)
        profile = marked.get(id(record)) if marked else None
        if profile is not None:
            root.add_event(
                sc.EVENT_PROFILE,
                {sc.ATTR_PROFILE_FILE: profile[0], sc.ATTR_PROFILE_TRIGGER: profile[1]},
                timestamp=times[-1] + offset,
            )
        root.end(end_time=times[-1] + offset)
        return root
