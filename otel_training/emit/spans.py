"""Spans built after the step from its timeline, with explicit timestamps."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from otel_training import semconv as sc

_ROOT_CONTEXT = Context()


def emit_step_spans(tracer, step, batch_name: str, times: Sequence[int], host: Sequence[int],
                    device: Optional[Sequence[Optional[int]]], offset: int,
                    attributes: Dict[str, Any], idle_by_rec: Optional[Dict[int, int]]) -> Any:
    """Create the root ``step`` span and one child per phase record; returns the
    (ended) root span. ``times`` are the marks to use (GPU-synchronized when the
    device is observed) on the perf_counter scale; ``offset`` maps them to epoch ns."""
    root = tracer.start_span(sc.SPAN_STEP, context=_ROOT_CONTEXT, start_time=times[0] + offset,
                             attributes=attributes)
    contexts = {}
    root_ctx = trace.set_span_in_context(root)
    for i, rec in enumerate(step.phases):
        if rec.end < 0:
            continue
        name = batch_name if rec.name == "batch" else rec.name
        parent_ctx = contexts.get(id(rec.up), root_ctx) if rec.up is not None else root_ctx
        attrs = {sc.ATTR_HOST_DURATION: (host[rec.end] - host[rec.start]) / 1e9}
        if device is not None:
            attrs[sc.ATTR_DEVICE_DURATION] = (times[rec.end] - times[rec.start]) / 1e9
            if idle_by_rec is not None and i in idle_by_rec:
                attrs[sc.ATTR_GPU_IDLE] = idle_by_rec[i] / 1e9
        span = tracer.start_span(name, context=parent_ctx, start_time=times[rec.start] + offset,
                                 attributes=attrs)
        span.end(end_time=times[rec.end] + offset)
        contexts[id(rec)] = trace.set_span_in_context(span)
    if step.error is not None:
        root.set_status(Status(StatusCode.ERROR, f"{type(step.error).__name__}: {step.error}"))
        root.record_exception(step.error)
    root.end(end_time=times[-1] + offset)
    return root
