"""bench-data results as OpenTelemetry gauges (docs/telemetry.md, "bench-data").

Exported once, at the end, when ``OTEL_METRICS_EXPORTER`` names an exporter
(``otlp``, ``console``) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` is set; ``OTEL_METRICS_EXPORTER=none`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

METRIC_THROUGHPUT = "training.data.throughput"
METRIC_STAGE_DURATION = "training.data.stage.duration"
ATTR_NUM_WORKERS = "training.data.num_workers"
ATTR_PIN_MEMORY = "training.data.pin_memory"
ATTR_BATCH_SIZE = "training.data.batch_size"
ATTR_DATASET = "training.data.dataset"
ATTR_STAGE = "training.data.stage"  # load | transform | getitem | collate
SERVICE_NAME = "otel-training-bench-data"


def _exporters(environ: Mapping[str, str]) -> list[Any]:
    names = [n.strip().lower() for n in environ.get("OTEL_METRICS_EXPORTER", "").split(",") if n.strip()]
    endpoint = environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if "none" in names:
        return []
    if not names:
        names = ["otlp"] if endpoint else []
    out: list = []
    for name in names:
        if name == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            out.append(ConsoleMetricExporter())
        elif name == "otlp":
            protocol = (
                environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc"
            ).strip()
            if protocol == "http/protobuf":
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            else:
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (  # type: ignore[assignment]
                    OTLPMetricExporter,
                )
            out.append(OTLPMetricExporter())
        else:
            raise ValueError(f"OTEL_METRICS_EXPORTER={name!r}: bench-data supports otlp, console, none")
    return out


def record(meter: Any, result: dict) -> None:
    """Set the gauges from one bench-data result."""
    base = {ATTR_DATASET: result["dataset"], ATTR_BATCH_SIZE: int(result["batch_size"])}
    tput = meter.create_gauge(
        METRIC_THROUGHPUT, unit="{sample}/s", description="DataLoader samples per second for one configuration"
    )
    for r in result["runs"]:
        tput.set(
            r["samples_per_s"], {**base, ATTR_NUM_WORKERS: r["num_workers"], ATTR_PIN_MEMORY: bool(r["pin_memory"])}
        )
    stage = meter.create_gauge(
        METRIC_STAGE_DURATION, unit="s", description="mean seconds per sample (per batch for collate)"
    )
    s = result["samples"]
    for key, name in (("load_ms", "load"), ("transform_ms", "transform"), ("getitem_ms", "getitem")):
        if s.get(key) is not None:
            stage.set(s[key] / 1e3, {**base, ATTR_STAGE: name})
    if result.get("collate_ms") is not None:
        stage.set(result["collate_ms"] / 1e3, {**base, ATTR_STAGE: "collate"})


def export(result: dict, environ: Mapping[str, str] | None = None, reader: Any = None) -> str | None:
    """Export ``result`` if configured (or into ``reader``); a one-line note on failure."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    env = os.environ if environ is None else environ
    try:
        readers = (
            [reader]
            if reader is not None
            else [PeriodicExportingMetricReader(e, export_interval_millis=3_600_000) for e in _exporters(env)]
        )
    except (ValueError, ImportError) as exc:
        return f"metrics not exported: {exc}"
    if not readers:
        return None
    resource = Resource.create()
    if not env.get("OTEL_SERVICE_NAME") and str(resource.attributes.get("service.name", "")).startswith(
        "unknown_service"
    ):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    try:
        record(provider.get_meter("otel_training.cli.bench_data"), result)
        if reader is None:
            ok = provider.force_flush(timeout_millis=10_000)
            if not ok:
                return "metrics export did not complete (is the Collector reachable?)"
    except Exception as exc:  # never fail the benchmark over telemetry
        return f"metrics not exported: {type(exc).__name__}: {exc}"
    finally:
        if reader is None:
            provider.shutdown(timeout_millis=5_000)
    return None
