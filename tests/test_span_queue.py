"""Default settings at 1000 steps/s: the SDK's span queue drops nothing.

Tracing every step under the same load drops thousands of spans through a slow
exporter (checked when this test was written); the default tail capture is what
keeps the queue safe."""

from __future__ import annotations

import time

import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_training
from otel_training import runtime
from otel_training.config import load_config
from otel_training.instrumentor import TrainingInstrumentor
from tests.conftest import EndedSpans

STEPS = 3000


class SlowExporter(InMemorySpanExporter):
    """An exporter with a 500 ms round trip, like a Collector across a network."""

    def export(self, spans):
        time.sleep(0.5)
        return super().export(spans)


def test_no_span_is_dropped_at_1000_steps_per_second():
    exporter = SlowExporter()
    tp = TracerProvider()
    made = EndedSpans()
    tp.add_span_processor(made)
    tp.add_span_processor(BatchSpanProcessor(exporter))  # the SDK's default queue and delays
    mp = MeterProvider(metric_readers=[InMemoryMetricReader()])
    config = load_config({})  # default tail capture: slow steps, 1 in 100, 20/s at most
    inst = TrainingInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=mp, config=config)
    try:
        rt = runtime.current()
        model = torch.nn.Linear(4, 1)
        x = torch.randn(2, 4)
        start = time.perf_counter()
        for i in range(STEPS):
            deadline = start + (i + 1) / 1000.0  # paced at 1000 steps/s
            with otel_training.step():
                model(x)
                if i % 7 == 0:  # every 7th step is slow: a burst of tail captures
                    time.sleep(0.002)
            while time.perf_counter() < deadline:
                pass
        assert rt.pipeline.flush(10)
        created = made.count
    finally:
        inst.uninstrument()
    tp.force_flush()
    assert created > 0
    assert rt.telemetry.spans_dropped == 0
    assert len(exporter.get_finished_spans()) == created
    tp.shutdown()
    mp.shutdown()
