"""Guard the OpenTelemetry SDK's export path: count what is lost, bound what blocks.

The SDK configured by ``opentelemetry-instrument`` (or handed to ``instrument()``)
exports on its own threads: a ``BatchSpanProcessor`` worker and a
``PeriodicExportingMetricReader`` ticker. We never replace them; we attach to them:

* each span and metric exporter's ``export`` is wrapped (an instance attribute, so
  the exporter object stays the same) to count failed exports and the spans they
  carried (``training.telemetry.export.failures``, ``training.telemetry.spans.dropped``);
* each batch span processor's queue-drop hook is wrapped to count spans refused by a
  full queue;
* ``flush``/``shutdown`` run the SDK's blocking calls on a helper thread and wait at
  most a given time: the OTLP exporters retry with backoff for up to their timeout
  (10 s by default) and ``BatchSpanProcessor.force_flush`` ignores its timeout, so an
  unreachable Collector must never hold a finished job;
* ``abort`` shuts the exporters down, which interrupts a retry backoff at once (the
  OTLP exporters wait on their shutdown event) and closes the gRPC channel;
* ``silence`` (in a forked child or a DataLoader worker) makes every export a no-op
  and stops the SDK's threads there, so workers never export the parent's state again;
* the SDK's export loggers are held back (``sdk_logs.ExportLogHold``): the first
  failed export prints one line of ours with its cause, and no more; an export that
  raises (a gRPC channel our ``abort`` closed under it: ``ValueError: Cannot invoke RPC
  on closed channel!``) is counted as a failure and never reaches the SDK's
  traceback-logging handler.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from otel_training.export import sdk
from otel_training.export.sdk_logs import ExportLogHold, dropping_line, exc_cause
from otel_training.export.selftelemetry import COMPONENT_METRICS, COMPONENT_TRACES

logger = logging.getLogger("otel_training")


def _name(result: Any) -> str:
    return getattr(result, "name", "") or ""


class ExportGuard:
    """Attached to one tracer provider and one meter provider (either may be absent)."""

    def __init__(self, telemetry) -> None:
        self.telemetry = telemetry
        self.tracer_provider = None
        self.meter_provider = None
        self._undo: list[Callable[[], None]] = []
        self._span_exporters: list = []
        self._metric_exporters: list = []
        self._batch_processors: list = []  # the SDK's BatchProcessor objects (span queues)
        self._readers: list = []
        self.silenced = False
        self.aborted = False
        self.backing_off: set = set()  # idents of threads inside an export's retry backoff
        self._pid = os.getpid()
        # The OTLP exporters log "Transient error ... retrying in N s" on the exporting
        # thread just before sleeping in their backoff: seen there, a flush at exit gives
        # up at once instead of waiting out the backoff (the time budget bounds it anyway).
        self.logs = ExportLogHold(lambda: self.backing_off.add(threading.get_ident()))
        self._said_lock = threading.Lock()
        self.said: str | None = None  # our one line about dropped telemetry, once printed

    # -- attaching -------------------------------------------------------------------------
    def attach(self, tracer_provider, meter_provider) -> ExportGuard:
        """Wrap what the SDK set up; what its internals do not show (another SDK
        version) is left alone: exports still work, only our counts miss it."""
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        for sp in sdk.span_processors(tracer_provider):
            exporter = sdk.span_exporter(sp)
            if exporter is not None:
                self._try_wrap(exporter, COMPONENT_TRACES)
            batch = sdk.batch_queue_owner(sp)
            if batch is not None:
                self._batch_processors.append(batch)
                undo = sdk.count_queue_drops(batch, self.telemetry.drop_spans)
                if undo is not None:
                    self._undo.append(undo)
        for reader in sdk.metric_readers(meter_provider):
            self._readers.append(reader)
            exporter = sdk.reader_exporter(reader)
            if exporter is not None:
                self._try_wrap(exporter, COMPONENT_METRICS)
        self._undo.append(self.logs.attach())
        return self

    def _try_wrap(self, exporter, component: str) -> None:
        try:
            self._wrap_exporter(exporter, component)
        except Exception as exc:  # e.g. an exporter with __slots__: not counted, still works
            logger.debug("otel-training: cannot guard %r: %r", exporter, exc)

    def _wrap_exporter(self, exporter, component: str) -> None:
        if getattr(exporter, "_otel_training_guard", None) is not None:
            return  # already guarded (another runtime in this process)
        original_export = exporter.export
        original_shutdown = getattr(exporter, "shutdown", None)
        had_export = "export" in vars(exporter)
        had_shutdown = "shutdown" in vars(exporter)
        guard = self
        spans = component == COMPONENT_TRACES
        state = {"shut": False}
        endpoint = sdk.exporter_endpoint(exporter)

        def export(batch, *args, **kwargs):
            if guard.silenced or guard._pid != os.getpid():
                return _success(component)
            if guard.aborted:  # after our bounded shutdown gave up: fail fast, quietly
                guard._failed(component, batch if spans else None, endpoint)
                return _failure(component)
            try:
                result = original_export(batch, *args, **kwargs)
            except Exception as exc:
                # Counted and said in our line; raised on, the SDK would log a traceback.
                # After our abort (the channel closed under it) the abort is the cause.
                cause = None if guard.aborted else exc_cause(exc)
                guard._failed(component, batch if spans else None, endpoint, cause)
                return _failure(component)
            finally:
                guard.backing_off.discard(threading.get_ident())
            if _name(result) == "FAILURE":
                guard._failed(component, batch if spans else None, endpoint)
            return result

        def shutdown(*args, **kwargs):
            if state["shut"]:
                return None  # the SDK shuts down what we already shut: no warning
            state["shut"] = True
            if original_shutdown is not None:
                return original_shutdown(*args, **kwargs)
            return None

        exporter.export = export
        exporter._otel_training_guard = self
        if original_shutdown is not None:
            exporter.shutdown = shutdown
        (self._span_exporters if spans else self._metric_exporters).append(exporter)

        def undo(e=exporter) -> None:
            for name, had in (("export", had_export), ("shutdown", had_shutdown), ("_otel_training_guard", False)):
                if not had:
                    try:
                        delattr(e, name)
                    except AttributeError:
                        pass
            if had_export:
                e.export = original_export
            if had_shutdown and original_shutdown is not None:
                e.shutdown = original_shutdown

        self._undo.append(undo)

    def _failed(self, component: str, batch, endpoint: str | None, cause: str | None = None) -> None:
        try:
            count = len(batch) if batch is not None else 0
        except TypeError:
            count = 0
        self.telemetry.export_failed(component, count)
        logged = self.logs.take()  # this thread's export logged why (held back)
        if self.said is not None:
            return
        with self._said_lock:
            if self.said is not None:
                return
            cause = cause or logged or self.logs.first_cause
            if cause is None:
                cause = "not sent within OTEL_TRAINING_SHUTDOWN_TIMEOUT at exit" if self.aborted else "export failed"
            self.said = dropping_line(endpoint, cause)
        try:
            print(self.said, file=sys.stderr, flush=True)
        except Exception:  # pragma: no cover - a closed stderr at exit
            pass

    def remove(self) -> None:
        """The handle protocol: ``detach``."""
        self.detach()

    def detach(self) -> None:
        """Put every exporter and processor back exactly as it was."""
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as exc:  # pragma: no cover
                self.telemetry.internal_error("export_guard", exc)
        self._span_exporters = []
        self._metric_exporters = []
        self._batch_processors = []
        self._readers = []

    # -- bounded operations ------------------------------------------------------------------
    def discard_pending(self) -> int:
        """Empty the span queues (after ``abort`` nothing will send them); returns how
        many spans were there, for the caller to count as dropped."""
        return sum(sdk.empty_span_queue(batch) for batch in self._batch_processors)

    def flush(self, timeout: float) -> bool:
        """Force-flush both providers, waiting at most ``timeout`` s; True if done.

        Gives up early (False) once an export is waiting to retry: the Collector
        refused it, and its backoff (1 s, 2 s, ...) would outlast any exit budget."""
        calls: list[Callable[[], Any]] = []
        if self.tracer_provider is not None and hasattr(self.tracer_provider, "force_flush"):
            calls.append(lambda: self.tracer_provider.force_flush(int(max(timeout, 0.001) * 1000)))
        if self.meter_provider is not None and hasattr(self.meter_provider, "force_flush"):
            calls.append(lambda: self.meter_provider.force_flush(max(timeout, 0.001) * 1000))
        return _bounded(calls, timeout, "flush", give_up=lambda: bool(self.backing_off))

    def abort(self) -> None:
        """Give up on the Collector: interrupt retries, fail every later export at once."""
        self.aborted = True
        for exporter in self._span_exporters + self._metric_exporters:
            try:
                exporter.shutdown()  # our wrapper: the SDK's later call is a quiet no-op
            except Exception as exc:
                self.telemetry.internal_error("export_guard", exc)

    def shutdown_providers(self, timeout: float) -> bool:
        """Shut both providers down within ``timeout`` s, then make sure nothing at
        interpreter exit waits on them again (their own ``atexit`` handlers)."""
        calls: list[Callable[[], Any]] = []
        tp, mp = self.tracer_provider, self.meter_provider
        if tp is not None and hasattr(tp, "shutdown"):
            calls.append(tp.shutdown)
        if mp is not None and hasattr(mp, "shutdown"):
            calls.append(lambda: mp.shutdown(timeout_millis=max(timeout, 0.001) * 1000))
        done = _bounded(calls, timeout, "shutdown")
        if not done:
            self.abort()
        import atexit

        for provider in (tp, mp):
            if provider is None:
                continue
            try:
                atexit.unregister(provider.shutdown)
            except Exception:  # pragma: no cover
                pass
        return done

    # -- workers ---------------------------------------------------------------------------
    def silence(self, join_timeout: float = 0.0) -> None:
        """In a forked child or a DataLoader worker: no export ever leaves this process,
        and the SDK's export threads here stop (after a fork the SDK restarts them)."""
        self.silenced = True
        threads = [sdk.stop_batch_worker(batch) for batch in self._batch_processors]
        threads += [sdk.stop_reader_ticker(reader) for reader in self._readers]
        if join_timeout > 0:
            deadline = time.monotonic() + join_timeout
            for thread in threads:
                if thread is not None and thread is not threading.current_thread():
                    try:
                        thread.join(max(0.0, deadline - time.monotonic()))
                    except RuntimeError:  # never started
                        pass


def _success(component: str):
    if component == COMPONENT_TRACES:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS
    from opentelemetry.sdk.metrics.export import MetricExportResult

    return MetricExportResult.SUCCESS


def _failure(component: str):
    if component == COMPONENT_TRACES:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.FAILURE
    from opentelemetry.sdk.metrics.export import MetricExportResult

    return MetricExportResult.FAILURE


def _bounded(calls: list, timeout: float, what: str, give_up: Callable[[], bool] | None = None) -> bool:
    """Run each of ``calls`` on its own daemon thread (traces and metrics side by side);
    wait at most ``timeout`` seconds for all of them, or until ``give_up()``. True if
    all finished."""
    if not calls:
        return True
    deadline = time.monotonic() + max(0.0, timeout)
    events = []
    for i, call in enumerate(calls):
        done = threading.Event()

        def run(call=call, done=done) -> None:
            try:
                call()
            except Exception as exc:  # the SDK raises when a reader failed
                logger.debug("otel-training: %s: %r", what, exc)
            finally:
                done.set()

        threading.Thread(target=run, name=f"otel-training-{what}-{i}", daemon=True).start()
        events.append(done)
    for done in events:
        while not done.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (give_up is not None and give_up()):
                return False
            done.wait(min(remaining, 0.01))
    return True
