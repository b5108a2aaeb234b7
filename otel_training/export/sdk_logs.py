"""The OpenTelemetry SDK's export logs, held back while we are instrumented.

With no Collector, or an endpoint that does not speak OTLP, the SDK's exporters log
a line at every retry and every failed export (one every few seconds for the whole
run, mixed into the user's progress bars), and its batch processors log a traceback
for an export that raised. While instrumented, ``ExportLogHold`` -- a ``logging``
filter on those loggers -- keeps their warnings and errors off the user's stderr. It
remembers why each export thread's last export failed, so that ``ExportGuard`` can
say so once, in one line of ours (``dropping_line``); the losses are counted in the
run summary's telemetry section. ``uninstrument()`` removes the filter.

Debug and info records pass: someone who turned those loggers up wants them.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

# Where the SDK logs export failures, retries and shutdown races (the lowest SDK
# pyproject.toml allows and the newest): the OTLP exporters (the HTTP ones log their
# client's retries on the exporter's own logger), the batch processors and the
# periodic metric reader. A name an SDK version lacks costs an empty logger.
EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc._log_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._log_exporter",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk.metrics._internal.export",
)

_MAX_CAUSE = 110
_HTTP_STATUS = re.compile(r"code: (\d{3}), reason: (.+?)\.?$")
_ERRNO = re.compile(r"\[Errno -?\d+\] ([^\"')]+)")
_DETAILS = re.compile(r"[Ee]rror details: (.+)$")
# HTTP answers of a server that has no OTLP receiver at that path or for POST.
_NOT_OTLP = {"404", "405", "501"}


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_CAUSE else text[: _MAX_CAUSE - 3] + "..."


def cause_of(message: str, exc: BaseException | None = None) -> str | None:
    """Why an export failed, in a few words, from an SDK log message (or the exception
    it logged); None for a message that tells no cause ("Shutdown in progress", "due to
    timeout, max retries or shutdown", gRPC's "Channel closed!")."""
    if "Connection refused" in message or "ECONNREFUSED" in message:
        return "connection refused"
    m = _HTTP_STATUS.search(message)
    if m:
        code, reason = m.group(1), m.group(2).strip()
        return f"HTTP {code} {reason}" + (", not an OTLP receiver" if code in _NOT_OTLP else "")
    m = _ERRNO.search(message)
    if m:
        return _short(m.group(1))
    m = _DETAILS.search(message)
    if m:  # gRPC: "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:...: <why>"
        if "Channel closed" in m.group(1):
            # An RPC cancelled by its channel's close: the exit-time abort (or the SDK's
            # shutdown) did that, so the channel tells nothing of why exports failed.
            return None
        if "Failed parsing HTTP/2" in m.group(1):
            return "not a gRPC server (for OTLP/HTTP set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf)"
        return _short(m.group(1).rsplit(": ", 1)[-1])
    if exc is not None:
        return exc_cause(exc)
    return None


def exc_cause(exc: BaseException) -> str:
    return _short(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


class ExportLogHold(logging.Filter):
    """Holds back the SDK's export warnings and errors; keeps their causes per thread."""

    def __init__(self, on_retry: Callable[[], None]) -> None:
        super().__init__("")
        self._on_retry = on_retry
        self._causes: dict[int, str] = {}  # thread ident -> cause of its last failing export
        self.first_cause: str | None = None
        self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: hold it all the same
            message = str(record.msg)
        if "retrying in" in message:
            self._on_retry()
        exc = record.exc_info[1] if record.exc_info else None
        cause = cause_of(message, exc)
        if cause is not None:
            self._causes[threading.get_ident()] = cause
            if self.first_cause is None:
                self.first_cause = cause
        self.held += 1
        return False

    def take(self) -> str | None:
        """The cause this thread's export logged last (and forget it)."""
        return self._causes.pop(threading.get_ident(), None)

    def attach(self) -> Callable[[], None]:
        """Filter every export logger; returns the undo."""
        loggers = [logging.getLogger(name) for name in EXPORT_LOGGERS]
        for log in loggers:
            log.addFilter(self)

        def undo() -> None:
            for log in loggers:
                log.removeFilter(self)

        return undo


def dropping_line(endpoint: str | None, cause: str) -> str:
    where = f"{endpoint}: " if endpoint else ""
    return (
        f"otel-training: telemetry is being dropped ({where}{cause}); "
        "training goes on, losses are counted in the run summary"
    )
