"""Every access to private OpenTelemetry SDK internals, in one place.

The public SDK API lets us create spans and instruments, flush and shut down; it
does not let us count spans a full queue refused, stop the export threads in a
forked child, or merge our binned histograms into a reader's collection. For those
we reach into SDK objects. Each function here checks that what it relies on is
there and returns None (or does nothing) when it is not, and the caller falls back
to the public path: exports still work, only a count or a speed-up is lost.

What we rely on (tested on the lowest SDK ``pyproject.toml`` allows and the newest,
``scripts/test.sh``):

* ``TracerProvider._active_span_processor._span_processors`` (nested processors);
  ``BatchSpanProcessor._batch_processor`` with ``_exporter``, ``_queue``,
  ``_metrics`` (its queue-drop hook), ``_shutdown``, ``_worker_awaken``,
  ``_worker_thread``; ``SimpleSpanProcessor.span_exporter``; an OTLP exporter's
  ``_endpoint`` (named in our one line about dropped telemetry);
* ``MeterProvider._sdk_config`` (``metric_readers``, ``views``, ``resource``,
  ``exemplar_filter``) or ``MeterProvider._metric_readers``;
* ``MetricReader._collect``, ``_instrument_class_temporality``,
  ``_instrument_class_aggregation``; ``PeriodicExportingMetricReader._exporter``,
  ``_shutdown_event``, ``_daemon_thread``, ``_export_interval_millis``;
* ``ExplicitBucketHistogramAggregation._boundaries`` and ``_record_min_max``;
* ``Tracer.id_generator`` (our tracer's ids come from a private generator);
* ``opentelemetry.sdk._configuration._OTelSDKConfigurator``: the set-up
  ``opentelemetry-instrument`` does from the ``OTEL_*`` variables (``instrument()``
  and our distro use it as they are).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any


def standard_configurator() -> type:
    """The SDK's own configurator class (what ``opentelemetry-instrument`` runs)."""
    from opentelemetry.sdk._configuration import _OTelSDKConfigurator

    return _OTelSDKConfigurator


# -- traces ---------------------------------------------------------------------------------
def span_processors(tracer_provider: Any) -> list:
    """The leaf span processors of an SDK tracer provider (none for others)."""
    multi = getattr(tracer_provider, "_active_span_processor", None)
    found = list(getattr(multi, "_span_processors", ()) or ())
    out = []
    while found:  # processors may nest (a multi processor added as a processor)
        sp = found.pop(0)
        inner = getattr(sp, "_span_processors", None)
        if inner:
            found.extend(inner)
        else:
            out.append(sp)
    return out


def span_exporter(processor: Any) -> Any:
    """The exporter a span processor sends to, or None."""
    batch = getattr(processor, "_batch_processor", None)
    exporter = getattr(batch, "_exporter", None) if batch is not None else None
    return exporter if exporter is not None else getattr(processor, "span_exporter", None)


def exporter_endpoint(exporter: Any) -> str | None:
    """Where an OTLP exporter sends (its ``_endpoint``: a URL, or host:port for gRPC)."""
    endpoint = getattr(exporter, "_endpoint", None)
    return endpoint if isinstance(endpoint, str) and endpoint else None


def batch_queue_owner(processor: Any) -> Any:
    """The object holding a batch span processor's queue (``_queue``), or None."""
    batch = getattr(processor, "_batch_processor", None)
    return batch if batch is not None and hasattr(batch, "_queue") else None


class _CountingQueueMetrics:
    """Stands in for a batch processor's internal metrics: counts queue drops."""

    def __init__(self, inner: Any, on_drop: Callable[[int], None]) -> None:
        self._inner = inner
        self._on_drop = on_drop

    def register_queue_size(self, get_queue_size) -> None:
        return self._inner.register_queue_size(get_queue_size)

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        try:
            self._on_drop(count)
        finally:
            self._inner.drop_items(count, error_type)

    def finish_items(self, count: int) -> None:
        return self._inner.finish_items(count)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def count_queue_drops(batch: Any, on_drop: Callable[[int], None]) -> Callable[[], None] | None:
    """Have ``on_drop(count)`` called for spans a full queue refuses; returns the undo,
    or None where the SDK has no such hook."""
    metrics = getattr(batch, "_metrics", None)
    if metrics is None or isinstance(metrics, _CountingQueueMetrics) or not hasattr(metrics, "drop_items"):
        return None
    batch._metrics = _CountingQueueMetrics(metrics, on_drop)
    return lambda: setattr(batch, "_metrics", metrics)


def empty_span_queue(batch: Any) -> int:
    """Discard the spans waiting in a batch processor's queue; how many there were."""
    queue = getattr(batch, "_queue", None)
    count = 0
    while queue:
        try:
            queue.pop()
        except IndexError:
            break
        count += 1
    return count


def stop_batch_worker(batch: Any) -> threading.Thread | None:
    """Empty the queue and tell the export thread to leave; that thread, or None."""
    try:
        batch._queue.clear()
        batch._shutdown = True
        set_event_in_child(batch._worker_awaken)
        return getattr(batch, "_worker_thread", None)
    except Exception:  # pragma: no cover - SDK internals changed
        return None


def use_id_generator(tracer: Any, generator: Any, default_class: type) -> bool:
    """Give ``tracer`` its own id generator where it uses the SDK's default one
    (a user's custom generator is kept); False where the tracer has none."""
    if type(getattr(tracer, "id_generator", None)) is not default_class:
        return False
    tracer.id_generator = generator
    return True


# -- metrics --------------------------------------------------------------------------------
def metric_readers(meter_provider: Any) -> list:
    """The SDK metric readers of ``meter_provider`` (none for other providers)."""
    readers = getattr(meter_provider, "_metric_readers", None)
    if readers is None:
        readers = getattr(getattr(meter_provider, "_sdk_config", None), "metric_readers", ())
    return list(readers or ())


def export_interval_s(meter_provider: Any) -> float | None:
    """The shortest export interval of the provider's periodic metric readers, in
    seconds (None: no periodic reader)."""
    intervals = []
    for reader in metric_readers(meter_provider):
        ms = getattr(reader, "_export_interval_millis", None)
        if isinstance(ms, (int, float)) and 0 < ms < math.inf:
            intervals.append(ms / 1000)
    return min(intervals) if intervals else None


def meter_config(meter_provider: Any) -> Any:
    """The SDK meter provider's configuration (``views``, ``resource``,
    ``exemplar_filter``), or None."""
    return getattr(meter_provider, "_sdk_config", None)


def reader_exporter(reader: Any) -> Any:
    return getattr(reader, "_exporter", None)


def reader_histogram_plan(reader: Any, instrument_class: type) -> tuple | None:
    """(collect function, temporality, aggregation) a reader applies to histograms of
    ``instrument_class``, or None where the reader does not show them."""
    collect = getattr(reader, "_collect", None)
    temporality = getattr(reader, "_instrument_class_temporality", {}).get(instrument_class)
    aggregation = getattr(reader, "_instrument_class_aggregation", {}).get(instrument_class)
    if not callable(collect) or temporality is None:
        return None
    return collect, temporality, aggregation


def replace_collect(reader: Any, collect: Callable) -> None:
    """Make ``collect`` the reader's collection (it calls the original itself)."""
    reader._collect = collect


def explicit_buckets(aggregation: Any) -> tuple | None:
    """(boundaries or None for the instrument's advice, records min/max) of an
    explicit-bucket histogram aggregation; None for any other aggregation."""
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation

    if type(aggregation) is not ExplicitBucketHistogramAggregation:
        return None
    return getattr(aggregation, "_boundaries", None), getattr(aggregation, "_record_min_max", False) is True


def stop_reader_ticker(reader: Any) -> threading.Thread | None:
    """In a forked child: make a periodic reader's ticker leave without collecting
    again (after a fork that could wait forever on a lock a parent thread held);
    that thread, or None."""
    try:
        reader.collect = _no_collect
        event = getattr(reader, "_shutdown_event", None)
        if event is not None and not set_event_in_child(event):
            # The ticker re-reads the attribute after each wait: it leaves then.
            stop = threading.Event()
            stop.set()
            reader._shutdown_event = stop
        return getattr(reader, "_daemon_thread", None)
    except Exception:  # pragma: no cover
        return None


def _no_collect(*args: Any, **kwargs: Any) -> None:
    return None


def set_event_in_child(event: Any) -> bool:
    """``event.set()`` after a fork, never blocking on a lock another thread held at
    the fork (it stays held in the child forever). False if it could not be set."""
    cond = getattr(event, "_cond", None)
    try:
        if cond is None or cond.acquire(True, 0.05):
            if cond is not None:
                cond.release()
            event.set()
            return True
    except Exception:  # pragma: no cover - best effort
        pass
    return False


__all__: list[str] = [
    "standard_configurator",
    "span_processors",
    "span_exporter",
    "exporter_endpoint",
    "batch_queue_owner",
    "count_queue_drops",
    "empty_span_queue",
    "stop_batch_worker",
    "use_id_generator",
    "metric_readers",
    "meter_config",
    "reader_exporter",
    "reader_histogram_plan",
    "replace_collect",
    "explicit_buckets",
    "stop_reader_ticker",
    "set_event_in_child",
]
