"""An OTLP receiver for ``otel-training top``: gRPC and HTTP (protobuf or JSON), as a
Collector's ``otlp`` receiver takes them, on loopback by default.

Metric requests go to ``sink`` (the live run's ``add``); traces and logs are
acknowledged and dropped, so a job that sends them hears no error. A request the
sink fails on is still acknowledged: the viewer's problem never becomes the job's
export failure.
"""

from __future__ import annotations

import gzip
import logging
import threading
import zlib
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("otel_training")

MAX_BODY = 64 * 2**20  # an OTLP request larger than this is refused (HTTP 413)


def _proto() -> Any:
    """The OTLP protobuf modules (opentelemetry-proto, a dependency of the OTLP exporters)."""
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class P:
        metrics, metrics_grpc = metrics_service_pb2, metrics_service_pb2_grpc
        trace, trace_grpc = trace_service_pb2, trace_service_pb2_grpc
        logs, logs_grpc = logs_service_pb2, logs_service_pb2_grpc

    return P


class Receiver:
    """OTLP/gRPC on ``grpc_address`` and OTLP/HTTP on ``http_address`` (``host:port``;
    port 0: any free one; None: that one off)."""

    def __init__(
        self,
        sink: Callable[[Any], None],
        grpc_address: str | None = "127.0.0.1:4317",
        http_address: str | None = "127.0.0.1:4318",
    ) -> None:
        self._sink = sink
        self._grpc_address, self._http_address = grpc_address, http_address
        self._grpc: Any = None
        self._http: ThreadingHTTPServer | None = None
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.requests = 0  # metric requests taken
        self.failed = 0  # of them, ones the sink failed on
        self._lock = threading.Lock()

    # -- what both transports hand in ---------------------------------------------------------
    def take(self, request: Any) -> None:
        try:
            self._sink(request)
            ok = True
        except Exception as exc:  # the viewer's bug: logged, the job still hears success
            logger.debug("otel-training top: a metrics request was not read (%s: %s)", type(exc).__name__, exc)
            ok = False
        with self._lock:
            self.requests += 1
            self.failed += 0 if ok else 1

    # -- start and stop -------------------------------------------------------------------------
    def start(self) -> Receiver:
        p = _proto()
        if self._grpc_address is not None:
            self._start_grpc(p)
        if self._http_address is not None:
            host, _, port = self._http_address.rpartition(":")
            self._http = ThreadingHTTPServer((host or "127.0.0.1", int(port)), _handler(self, p))
            self._http.daemon_threads = True
            self.http_port = self._http.server_address[1]
            threading.Thread(target=self._http.serve_forever, name="otel-training-top-http", daemon=True).start()
        return self

    def _start_grpc(self, p: Any) -> None:
        import grpc

        receiver = self

        class Metrics(p.metrics_grpc.MetricsServiceServicer):
            def Export(self, request, context):  # noqa: N802 (the service's name)
                receiver.take(request)
                return p.metrics.ExportMetricsServiceResponse()

        class Traces(p.trace_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802
                return p.trace.ExportTraceServiceResponse()

        class Logs(p.logs_grpc.LogsServiceServicer):
            def Export(self, request, context):  # noqa: N802
                return p.logs.ExportLogsServiceResponse()

        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otel-training-top-grpc"),
            options=[("grpc.max_receive_message_length", MAX_BODY)],
        )
        p.metrics_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
        p.trace_grpc.add_TraceServiceServicer_to_server(Traces(), server)
        p.logs_grpc.add_LogsServiceServicer_to_server(Logs(), server)
        port = server.add_insecure_port(self._grpc_address)
        if not port:
            raise OSError(f"cannot listen on {self._grpc_address} (in use?)")
        server.start()
        self._grpc, self.grpc_port = server, port

    def where(self) -> str:
        """The addresses listened on, for the user."""
        parts = []
        if self.grpc_port is not None:
            parts.append(f"OTLP/gRPC {self._grpc_address.rpartition(':')[0]}:{self.grpc_port}")  # type: ignore[union-attr]
        if self.http_port is not None:
            parts.append(f"OTLP/HTTP {self._http_address.rpartition(':')[0]}:{self.http_port}")  # type: ignore[union-attr]
        return ", ".join(parts)

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(0.5)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def _handler(receiver: Receiver, p: Any) -> type[BaseHTTPRequestHandler]:
    responses = {
        "/v1/metrics": (p.metrics.ExportMetricsServiceRequest, p.metrics.ExportMetricsServiceResponse, True),
        "/v1/traces": (p.trace.ExportTraceServiceRequest, p.trace.ExportTraceServiceResponse, False),
        "/v1/logs": (p.logs.ExportLogsServiceRequest, p.logs.ExportLogsServiceResponse, False),
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            known = responses.get(path)
            size = int(self.headers.get("Content-Length") or 0)
            if known is None:
                return self._reply(404, b"", "text/plain")
            if size > MAX_BODY:
                return self._reply(413, b"", "text/plain")
            body = self.rfile.read(size)
            request_type, response_type, metrics = known
            kind = (self.headers.get("Content-Type") or "application/x-protobuf").split(";")[0].strip()
            try:
                body = _inflate(body, (self.headers.get("Content-Encoding") or "").strip().lower())
                if kind == "application/json":
                    from google.protobuf import json_format

                    request = json_format.Parse(body, request_type(), ignore_unknown_fields=True)
                else:
                    request = request_type.FromString(body)
            except Exception:
                return self._reply(400, b"", "text/plain")
            if metrics:
                receiver.take(request)
            response = response_type()
            if kind == "application/json":
                self._reply(200, b"{}", kind)
            else:
                self._reply(200, response.SerializeToString(), "application/x-protobuf")

        def _reply(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            return  # the terminal belongs to the view

    return Handler


def _inflate(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body
