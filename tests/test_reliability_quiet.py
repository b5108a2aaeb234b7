"""Quiet without a Collector, in process: the SDK's export loggers are
held back while instrumented and given back on uninstrument; a failed export says so in
one line of ours, with its cause; an export that raises (a gRPC channel our exit-time
abort closed under it) is a counted failure, not a traceback. The end-to-end runs (real
processes, both protocols, 20 in a row) are in tests/test_reliability_unreachable.py."""

from __future__ import annotations

import dataclasses
import http.server
import logging
import threading
import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from otel_training.config import load_config
from otel_training.export.sdk_logs import EXPORT_LOGGERS, cause_of
from otel_training.instrumentor import TrainingInstrumentor
from tests.conftest import manual_steps
from tests.otlp_receiver import free_port

CONFIG = dataclasses.replace(
    load_config({}),
    trace_every_n=1,
    trace_max_per_second=1e6,
    hardware=False,
    gpu_timing="off",
    summary=False,
    integrations=(),
    shutdown_timeout=1.0,
)
DROPPED = "otel-training: telemetry is being dropped ("


class NotOTLP(http.server.BaseHTTPRequestHandler):
    """A web server with no OTLP receiver: every POST gets an HTML 404."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b"<html><body><h1>404 Not Found</h1></body></html>"
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def not_otlp():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotOTLP)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def instrument():
    made = []

    def start(tp, mp):
        inst = TrainingInstrumentor()
        inst.instrument(tracer_provider=tp, meter_provider=mp, config=CONFIG)
        made.append(inst)
        from otel_training.runtime import current

        return current()

    yield start
    for inst in made:
        if inst.is_instrumented_by_opentelemetry:
            inst.uninstrument()


def _sdk_records(caplog) -> list:
    return [r for r in caplog.records if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING]


def _wait(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_non_otlp_http_endpoint_is_one_line_of_ours_and_the_sdk_logs_come_back_on_uninstrument(
    instrument, not_otlp, caplog, capsys
):
    caplog.set_level(logging.WARNING)
    exporter = HttpSpanExporter(endpoint=f"{not_otlp}/v1/traces")
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=10))
    rt = instrument(tp, MeterProvider())
    for _ in range(3):  # three failed exports, each a line of the SDK's without us
        manual_steps(2)
        before = rt.telemetry.export_failures["traces"]
        _wait(lambda: rt.telemetry.export_failures["traces"] > before)
    assert _sdk_records(caplog) == []
    ours = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("otel-training")]
    assert ours == [
        f"{DROPPED}{not_otlp}/v1/traces: HTTP 404 Not Found, not an OTLP receiver); training goes on, "
        "losses are counted in the run summary"
    ]
    assert rt.summary_dict()["telemetry"]["export_failures"] >= 3
    assert rt.summary_dict()["telemetry"]["spans_dropped"] > 0

    held = logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    assert rt.guard.logs in held.filters
    rt_guard = rt.guard
    TrainingInstrumentor().uninstrument()
    for name in EXPORT_LOGGERS:
        assert rt_guard.logs not in logging.getLogger(name).filters
    exporter.export([])  # not ours any more: the SDK speaks for itself again
    assert any("404" in r.getMessage() for r in _sdk_records(caplog))
    tp.shutdown()


class SlowEncodingExporter(GrpcSpanExporter):
    """The real gRPC span exporter, its request encoding held until ``go``: the window
    in which our exit-time ``abort`` closes the channel under an export in flight."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.encoding = threading.Event()
        self.go = threading.Event()

    def _translate_data(self, data):
        self.encoding.set()
        self.go.wait(20)
        return super()._translate_data(data)


def test_an_export_on_the_channel_abort_closed_is_a_counted_failure_not_a_traceback(instrument, caplog, capsys):
    caplog.set_level(logging.WARNING)
    exporter = SlowEncodingExporter(endpoint=f"http://127.0.0.1:{free_port()}", insecure=True)
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=10))
    rt = instrument(tp, MeterProvider())
    manual_steps(2)
    assert exporter.encoding.wait(20)  # the SDK's worker is inside export, past its shutdown check
    rt.guard.abort()  # what shutdown does once the exit budget is spent: closes the channel
    exporter.go.set()  # the export goes on, on a closed channel (ValueError in gRPC)
    _wait(lambda: rt.telemetry.export_failures["traces"] >= 1)
    time.sleep(0.2)  # anything the SDK would log about it comes right after the return
    assert [r for r in caplog.records if r.exc_info] == []
    ours = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("otel-training")]
    assert len(ours) == 1 and ours[0].startswith(DROPPED), ours
    assert "OTEL_TRAINING_SHUTDOWN_TIMEOUT" in ours[0]  # the abort's doing, not the channel's
    tp.shutdown()


@pytest.mark.parametrize(
    "message, cause",
    [
        (
            "Transient error StatusCode.UNAVAILABLE encountered while exporting metrics to 127.0.0.1:48705, retrying in "
            "1.20s. Error details: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:48705: Failed "
            "to connect to remote host: Connection refused",
            "connection refused",
        ),
        (
            "Failed to export traces to 127.0.0.1:18999, error code: StatusCode.UNAVAILABLE, error details: failed to "
            "connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:18999: Failed parsing HTTP/2 (Expected "
            "SETTINGS frame as the first frame, got frame type 79)",
            "not a gRPC server (for OTLP/HTTP set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf)",
        ),
        (
            "Transient error HTTPConnectionPool(host='collector', port=4318): Max retries exceeded with url: /v1/traces "
            "(Caused by NameResolutionError(\"HTTPConnection(host='collector', port=4318): Failed to resolve 'collector' "
            '([Errno -2] Name or service not known)")) encountered while exporting spans batch, retrying in 0.98s.',
            "Name or service not known",
        ),
        ("Failed to export spans batch code: 404, reason: Not Found", "HTTP 404 Not Found, not an OTLP receiver"),
        ("Failed to export metrics batch code: 401, reason: Unauthorized", "HTTP 401 Unauthorized"),
        ("Shutdown in progress, aborting retry.", None),
        (
            "Failed to export metrics to 127.0.0.1:36941, error code: StatusCode.CANCELLED, error details: Channel "
            "closed!",
            None,
        ),
        ("Failed to export spans batch due to timeout, max retries or shutdown.", None),
    ],
)
def test_the_cause_of_a_failed_export_in_a_few_words(message, cause):
    assert cause_of(message) == cause
