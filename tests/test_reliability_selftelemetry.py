"""Self-telemetry: spans dropped, export failures and internal errors
are counted where they happen -- on the SDK's own export path -- exported as the
``training.telemetry.*`` counters of docs/telemetry.md, and named in the run-end summary."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_training
from otel_training import semconv as sc
from otel_training.config import load_config
from otel_training.export.guard import ExportGuard
from otel_training.export.sdk_logs import EXPORT_LOGGERS
from otel_training.instrumentor import TrainingInstrumentor
from otel_training.export.selftelemetry import SelfTelemetry
from otel_training.aggregate.run_model import SCHEMA
from otel_training.diagnosis.summary_text import render_summary as render
from tests.conftest import EndedSpans, manual_steps

CONFIG = dataclasses.replace(load_config({}), trace_every_n=1, trace_max_per_second=1e6, hardware=False,
                             gpu_timing="off", summary=False, integrations=(), shutdown_timeout=2.0)


class FailingSpanExporter(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        return SpanExportResult.FAILURE

    def shutdown(self):
        pass


class GatedSpanExporter(SpanExporter):
    """Blocks every export until ``gate`` is set; keeps what it exported."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.exported = []

    def export(self, spans):
        self.gate.wait(10)
        self.exported.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.gate.set()


class FailingMetricExporter(MetricExporter):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
        self.calls += 1
        return MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


_train = manual_steps


@pytest.fixture
def instrument():
    """``instrument(tracer_provider, meter_provider, **config)`` -> the Runtime."""
    started = []

    def start(tp, mp, **overrides):
        inst = TrainingInstrumentor()
        inst.instrument(tracer_provider=tp, meter_provider=mp,
                        config=dataclasses.replace(CONFIG, **overrides))
        started.append(inst)
        from otel_training.runtime import current

        return current()

    yield start
    for inst in started:
        if inst.is_instrumented_by_opentelemetry:
            inst.uninstrument()


def _points(reader: InMemoryMetricReader, name: str) -> list:
    data = reader.get_metrics_data()
    out = []
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    out.extend((m, p) for p in m.data.data_points)
    return out


def test_failed_span_exports_count_failures_and_the_spans_they_carried(instrument):
    exporter = FailingSpanExporter()
    tp = TracerProvider()
    made = EndedSpans()
    tp.add_span_processor(made)
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    rt = instrument(tp, MeterProvider(metric_readers=[reader]))
    _train(4)
    assert rt.pipeline.flush(5)
    tel = rt.telemetry
    assert exporter.calls > 0
    assert tel.export_failures["traces"] == exporter.calls  # SimpleSpanProcessor: one span a call
    assert tel.spans_dropped == exporter.calls == made.count

    failures = {p.attributes[sc.ATTR_COMPONENT]: p.value
                for _, p in _points(reader, sc.METRIC_EXPORT_FAILURES)}
    assert failures == {"traces": exporter.calls, "metrics": 0}
    ((metric, dropped),) = _points(reader, sc.METRIC_SPANS_DROPPED)
    assert dropped.value == exporter.calls and metric.unit == "{span}"
    assert metric.data.is_monotonic
    ((_, steps_dropped),) = _points(reader, sc.METRIC_STEPS_DROPPED)
    assert steps_dropped.value == 0
    assert "host.name" in dropped.attributes  # the common attributes ride along


def test_failed_metric_exports_are_counted_by_component(instrument):
    exporter = FailingMetricExporter()
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=60_000)
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    rt = instrument(tp, MeterProvider(metric_readers=[reader]))
    _train(2)
    assert rt.pipeline.flush(5)
    reader.force_flush()
    reader.force_flush()
    assert rt.telemetry.export_failures["metrics"] == exporter.calls == 2
    assert rt.telemetry.spans_dropped == 0
    assert rt.summary_dict()["telemetry"]["export_failures"] == 2


def test_spans_refused_by_a_full_span_queue_are_counted(instrument):
    exporter = GatedSpanExporter()
    tp = TracerProvider()
    made = EndedSpans()
    tp.add_span_processor(made)
    tp.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=4, max_export_batch_size=2,
                                             schedule_delay_millis=5))
    rt = instrument(tp, MeterProvider(metric_readers=[InMemoryMetricReader()]))
    _train(8)
    assert rt.pipeline.flush(5)
    exporter.gate.set()
    tp.force_flush()
    tel = rt.telemetry
    assert made.count > 4
    assert tel.spans_dropped > 0
    # Nothing unaccounted. (The SDK counts a drop when it finds the queue full; its
    # worker may take a batch between that check and the insert, so a count can be one
    # high under a race, never low.)
    assert len(exporter.exported) + tel.spans_dropped >= made.count
    assert tel.spans_dropped <= made.count - len(exporter.exported) + 2


def test_internal_errors_are_counted_by_component_and_exported(instrument):
    reader = InMemoryMetricReader()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    rt = instrument(tp, MeterProvider(metric_readers=[reader]))
    rt.on_error("dataloader", RuntimeError("boom"))
    rt.on_error("dataloader", RuntimeError("boom"))
    rt.on_error("forward", RuntimeError("boom"))
    errors = {p.attributes[sc.ATTR_COMPONENT]: p.value for _, p in _points(reader, sc.METRIC_INTERNAL_ERRORS)}
    assert errors == {"dataloader": 2, "forward": 1}


def test_the_run_end_summary_names_the_problems():
    tel = SelfTelemetry()
    summary = {"schema": SCHEMA, "modes": {}, "telemetry": tel.as_dict()}
    assert "telemetry problems" not in render(summary)
    tel.export_failed("traces", spans=7)
    tel.drop_spans(3)
    tel.internal_error("forward", RuntimeError("x"))
    line = [ln for ln in render({"schema": SCHEMA, "modes": {}, "telemetry": tel.as_dict()}).splitlines()
            if "telemetry problems" in ln]
    assert line == ["  telemetry problems: spans_dropped=10, export_failures=1, errors=1"]


def test_detach_puts_exporters_processors_and_loggers_back_exactly():
    span_exporter = InMemorySpanExporter()
    tp = TracerProvider()
    bsp = BatchSpanProcessor(span_exporter)
    tp.add_span_processor(bsp)
    metric_exporter = FailingMetricExporter()
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=60_000)
    mp = MeterProvider(metric_readers=[reader])
    before_metrics = bsp._batch_processor._metrics
    before_filters = {n: list(logging.getLogger(n).filters) for n in EXPORT_LOGGERS}
    guard = ExportGuard(SelfTelemetry()).attach(tp, mp)
    assert "export" in vars(span_exporter) and "export" in vars(metric_exporter)
    assert bsp._batch_processor._metrics is not before_metrics
    guard.detach()
    for exporter in (span_exporter, metric_exporter):
        assert not {"export", "shutdown", "_otel_training_guard"} & set(vars(exporter))
    assert bsp._batch_processor._metrics is before_metrics
    assert {n: list(logging.getLogger(n).filters) for n in EXPORT_LOGGERS} == before_filters
    tp.shutdown()
    mp.shutdown()


def test_uninstrument_detaches_the_guard(instrument):
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(tp, MeterProvider(metric_readers=[InMemoryMetricReader()]))
    assert "export" in vars(exporter)
    otel_training.uninstrument()
    assert "export" not in vars(exporter) and "shutdown" not in vars(exporter)


def test_a_second_shutdown_of_a_guarded_exporter_is_quiet(caplog):
    exporter = FailingSpanExporter()
    calls = []
    exporter.shutdown = lambda: calls.append(1)
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    guard = ExportGuard(SelfTelemetry()).attach(tp, None)
    guard.abort()
    tp.shutdown()  # the SDK shuts the exporter down again: ignored
    assert calls == [1]
    guard.detach()


def test_an_aborted_guard_fails_exports_at_once_and_counts_them():
    exporter = GatedSpanExporter()  # would block 10 s
    tel = SelfTelemetry()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    guard = ExportGuard(tel).attach(tp, None)
    guard.abort()
    started = time.monotonic()
    tp.get_tracer("t").start_span("s").end()
    assert time.monotonic() - started < 1.0
    assert tel.export_failures["traces"] == 1 and tel.spans_dropped == 1
    guard.detach()


def test_counters_stay_monotone_across_uninstrument_and_instrument_again(instrument):
    """The SDK keeps the first callbacks of an instrument name on a meter: a second
    instrumentation of the same providers must still be counted, and never go back."""
    exporter = FailingSpanExporter()
    tp = TracerProvider()
    made = EndedSpans()
    tp.add_span_processor(made)
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    values = []
    for _ in range(2):
        rt = instrument(tp, mp)
        _train(2)
        assert rt.pipeline.flush(5)
        ((_, point),) = _points(reader, sc.METRIC_SPANS_DROPPED)
        values.append(point.value)
        otel_training.uninstrument()
    assert 0 < values[0] < values[1] == exporter.calls
