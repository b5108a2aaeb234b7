"""Spans built after the step from its timeline, with explicit timestamps."""

from __future__ import annotations

import os
import random
from typing import Any, Dict, Optional, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from otel_training import semconv as sc

_ROOT_CONTEXT = Context()
_INHERITED = (sc.ATTR_RANK, sc.ATTR_LOCAL_RANK, sc.ATTR_WORLD_SIZE)

try:
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
except ImportError:  # pragma: no cover - API only
    RandomIdGenerator = None


if RandomIdGenerator is not None:
    class _PrivateRandomIdGenerator(RandomIdGenerator):
        """The SDK's random ids, from a generator of our own: training scripts reseed
        the global ``random`` (and torch.compile restores its state), which would
        repeat the SDK's default ids -- traces merged, the same ids on every rank."""

        def __init__(self) -> None:
            self._random = random.Random()
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=self._random.seed)

        def generate_span_id(self) -> int:
            span_id = self._random.getrandbits(64)
            while span_id == trace.INVALID_SPAN_ID:
                span_id = self._random.getrandbits(64)
            return span_id

        def generate_trace_id(self) -> int:
            trace_id = self._random.getrandbits(128)
            while trace_id == trace.INVALID_TRACE_ID:
                trace_id = self._random.getrandbits(128)
            return trace_id

    _PRIVATE_IDS = _PrivateRandomIdGenerator()


def _private_ids(tracer) -> None:
    """Give our own tracer (scope ``otel_training``) private random ids; a custom
    id generator configured by the user is kept."""
    if RandomIdGenerator is not None and type(getattr(tracer, "id_generator", None)) is RandomIdGenerator:
        tracer.id_generator = _PRIVATE_IDS


def emit_step_spans(tracer, step, batch_name: str, times: Sequence[int], host: Sequence[int],
                    device: Optional[Sequence[Optional[int]]], offset: int,
                    attributes: Dict[str, Any], idle_by_rec: Optional[Dict[int, int]]) -> Any:
    """Create the root ``step`` span and one child per phase record; returns the
    (ended) root span. ``times`` are the marks to use (GPU-synchronized when the
    device is observed) on the perf_counter scale; ``offset`` maps them to epoch ns."""
    _private_ids(tracer)
    root = tracer.start_span(sc.SPAN_STEP, context=_ROOT_CONTEXT, start_time=times[0] + offset,
                             attributes=attributes)
    spans = {}  # id(record) -> its span, for its children's context
    inherited = {k: attributes[k] for k in _INHERITED if k in attributes}
    root_ctx = trace.set_span_in_context(root)
    contexts = {}  # made only for records that have children
    for i, rec in enumerate(step.phases):
        if rec.end < 0:
            continue
        name = batch_name if rec.name == "batch" else rec.name
        parent_ctx = root_ctx
        up = rec.up
        if up is not None and id(up) in spans:
            parent_ctx = contexts.get(id(up))
            if parent_ctx is None:
                parent_ctx = contexts[id(up)] = trace.set_span_in_context(spans[id(up)])
        attrs = dict(inherited)  # rank attributes go on every span
        attrs[sc.ATTR_HOST_DURATION] = (host[rec.end] - host[rec.start]) / 1e9
        if device is not None:
            attrs[sc.ATTR_DEVICE_DURATION] = (times[rec.end] - times[rec.start]) / 1e9
            if idle_by_rec is not None and i in idle_by_rec:
                attrs[sc.ATTR_GPU_IDLE] = idle_by_rec[i] / 1e9
        span = tracer.start_span(name, context=parent_ctx, start_time=times[rec.start] + offset,
                                 attributes=attrs)
        span.end(end_time=times[rec.end] + offset)
        spans[id(rec)] = span
    if step.error is not None:
        root.set_status(Status(StatusCode.ERROR, f"{type(step.error).__name__}: {step.error}"))
        root.record_exception(step.error)
    root.end(end_time=times[-1] + offset)
    return root
