"""Bounded shutdown, in process: an unreachable or stuck Collector never
holds the end of a run longer than ``OTEL_TRAINING_SHUTDOWN_TIMEOUT``, what could not be
sent is counted, and SIGTERM runs the same bounded shutdown before the process dies.
The end-to-end checks (real processes, exit latency, signals) are in
tests/test_reliability_unreachable.py."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import otel_training
from otel_training.config import load_config
from otel_training.instrumentor import TrainingInstrumentor
from tests.otlp_receiver import free_port
from tests.conftest import EndedSpans, manual_steps

BUDGET = 1.0
CONFIG = dataclasses.replace(load_config({}), trace_every_n=1, trace_max_per_second=1e6, hardware=False,
                             gpu_timing="off", summary=False, integrations=(), shutdown_timeout=BUDGET)


class BlackholeExporter(SpanExporter):
    """An export that never returns and ignores shutdown (a Collector that accepts the
    connection and never answers)."""

    def __init__(self) -> None:
        self.entered = threading.Event()

    def export(self, spans):
        self.entered.set()
        threading.Event().wait(60)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


_train = manual_steps


@pytest.fixture
def run():
    made = []

    def start(tp, mp, **overrides):
        inst = TrainingInstrumentor()
        inst.instrument(tracer_provider=tp, meter_provider=mp, config=dataclasses.replace(CONFIG, **overrides))
        made.append(inst)
        from otel_training.runtime import current

        return current()

    yield start
    for inst in made:
        if inst.is_instrumented_by_opentelemetry:
            inst.uninstrument()


def _closed_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def test_unreachable_collector_shutdown_within_budget_and_counts_losses(run):
    endpoint = _closed_endpoint()
    tp = TracerProvider()
    made = EndedSpans()
    tp.add_span_processor(made)
    tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, insecure=True),
                                           export_interval_millis=60_000)
    mp = MeterProvider(metric_readers=[reader])
    rt = run(tp, mp)
    _train(5)
    started = time.monotonic()
    rt.shutdown(final=True)
    took = time.monotonic() - started
    assert took <= BUDGET + 0.3, f"shutdown took {took:.2f} s with a {BUDGET} s budget"
    tel = rt.telemetry.as_dict()
    assert tel["export_failures"] >= 1
    assert tel["spans_dropped"] == made.count > 0  # every span lost, every one counted
    # The SDK's own exit handlers have nothing left to wait for.
    started = time.monotonic()
    tp.shutdown()
    mp.shutdown(timeout_millis=100)
    assert time.monotonic() - started < 0.5


def test_a_collector_that_never_answers_cannot_hold_shutdown(run):
    exporter = BlackholeExporter()
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=10))
    rt = run(tp, MeterProvider())
    _train(3)
    assert rt.pipeline.flush(5)
    assert exporter.entered.wait(5)  # the SDK's worker is now stuck in export
    started = time.monotonic()
    rt.shutdown(final=True)
    took = time.monotonic() - started
    assert took <= BUDGET + 0.3, f"shutdown took {took:.2f} s with a {BUDGET} s budget"


def test_uninstrument_flushes_but_leaves_the_providers_running(run):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    run(tp, MeterProvider())
    _train(2)
    otel_training.uninstrument()
    assert exporter.get_finished_spans()  # flushed by uninstrument
    tp.get_tracer("user").start_span("after").end()
    tp.force_flush()
    assert exporter.get_finished_spans()[-1].name == "after"  # still running
    tp.shutdown()


def test_sigterm_handler_is_installed_only_over_the_default_and_removed_on_uninstrument(run):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    run(TracerProvider(), MeterProvider())
    assert callable(signal.getsignal(signal.SIGTERM))  # ours (what it does: the tests below)
    otel_training.uninstrument()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_user_sigterm_handler_is_left_alone(run):
    def user_handler(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, user_handler)
    try:
        run(TracerProvider(), MeterProvider())
        assert signal.getsignal(signal.SIGTERM) is user_handler
        otel_training.uninstrument()
        assert signal.getsignal(signal.SIGTERM) is user_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_runs_the_bounded_shutdown_then_the_default_action(run, monkeypatch):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    run(tp, MeterProvider())
    _train(2)
    kills = []
    monkeypatch.setattr("os.kill", lambda pid, sig: kills.append((sig, signal.getsignal(signal.SIGTERM))))
    signal.raise_signal(signal.SIGTERM)  # delivered for real; the handler's own kill is recorded
    assert kills == [(signal.SIGTERM, signal.SIG_DFL)]  # then die of SIGTERM, as without us
    assert {s.name for s in exporter.get_finished_spans()} >= {"step"}  # telemetry flushed
    tp.get_tracer("user").start_span("after").end()
    tp.force_flush()
    assert "after" not in {s.name for s in exporter.get_finished_spans()}  # providers shut down
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_handler_that_chains_to_ours_keeps_control(run, monkeypatch):
    """PyTorch Lightning installs its SIGTERM handler over ours and calls ours from it,
    then stops at the next step to save state: we only flush, and do not kill."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    rt = run(tp, MeterProvider())
    ours = signal.getsignal(signal.SIGTERM)
    stop_requested = []

    def lightning_like(signum, frame):
        stop_requested.append(signum)
        ours(signum, frame)

    previous = signal.signal(signal.SIGTERM, lightning_like)
    kills = []
    monkeypatch.setattr("os.kill", lambda pid, sig: kills.append(sig))
    try:
        _train(3)
        lightning_like(signal.SIGTERM, None)
        assert stop_requested == [signal.SIGTERM] and kills == []
        exported = len(exporter.get_finished_spans())
        assert exported  # what was measured is exported ...
        _train(1)
        assert rt.pipeline.flush(5)
        tp.force_flush()
        assert len(exporter.get_finished_spans()) > exported  # ... and the run goes on, measured
    finally:
        signal.signal(signal.SIGTERM, previous)
