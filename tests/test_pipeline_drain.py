"""How often the pipeline turns finished steps into telemetry.

It drains in batches (every 0.5 s by default: bigger batches cost the training thread
less, docs/performance.md); where metrics are exported faster than that, it drains
twice per export so that each export carries the steps before it.
"""

from __future__ import annotations

import dataclasses
import io
import time

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    InMemoryMetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from otel_training import semconv as sc
from otel_training.aggregate.pipeline import drain_interval
from otel_training.config import load_config
from otel_training.export.sdk import export_interval_s
from otel_training.instrumentor import TrainingInstrumentor

from .conftest import TEST_DEFAULTS


def test_drain_interval_follows_fast_exports_only():
    assert drain_interval(None) == 0.5  # no periodic export: the default batches
    assert drain_interval(60.0) == 0.5  # the SDK's default export interval
    assert drain_interval(0.4) == pytest.approx(0.2)  # twice per export
    assert drain_interval(0.001) == pytest.approx(0.01)  # never a busy loop
    assert drain_interval(0.0) == 0.5  # (not a periodic export)


def test_export_interval_is_the_shortest_periodic_reader():
    def periodic(ms):
        return PeriodicExportingMetricReader(ConsoleMetricExporter(out=io.StringIO()), ms)

    providers = [
        MeterProvider(metric_readers=[periodic(30_000), periodic(1_500), InMemoryMetricReader()]),
        MeterProvider(metric_readers=[InMemoryMetricReader()]),
    ]
    try:
        assert export_interval_s(providers[0]) == pytest.approx(1.5)
        assert export_interval_s(providers[1]) is None
        assert export_interval_s(object()) is None  # not the SDK's provider
    finally:
        for provider in providers:
            provider.shutdown()


def test_steps_reach_a_fast_export_without_a_flush():
    """With metrics exported every 100 ms, a finished step is processed within a
    fraction of a second, not at the 0.5 s default batch."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = PeriodicExportingMetricReader(ConsoleMetricExporter(out=io.StringIO()), 100)
    meter_provider = MeterProvider(metric_readers=[reader])
    config = dataclasses.replace(load_config({}), **TEST_DEFAULTS)
    instrumentor = TrainingInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider, config=config)
    try:
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,))), batch_size=4)
        for x, y in loader:  # 4 steps; the loop's end closes the last
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        done = time.monotonic()
        seen = 0
        while time.monotonic() - done < 0.35:
            seen = sum(1 for s in spans.get_finished_spans() if s.name == sc.SPAN_STEP)
            if seen >= 3:
                break
            time.sleep(0.005)
        assert seen >= 3, f"{seen} step spans 0.35 s after training, with 50 ms drains"
    finally:
        instrumentor.uninstrument()
        tracer_provider.shutdown()
        meter_provider.shutdown()
