"""Distro and configurator for ``opentelemetry-instrument``.

The distro only ``setdefault``s environment variables, so anything the user set
wins: OTLP exporters for traces and metrics, a metric export interval suited to
training dashboards, and resource attributes (``service.instance.id`` per process,
``training.run.id``). With ``opentelemetry-distro`` also installed, choose ours
with ``OTEL_PYTHON_DISTRO=otel_training`` and
``OTEL_PYTHON_CONFIGURATOR=otel_training``.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import MutableMapping

from opentelemetry.instrumentation.distro import BaseDistro
from opentelemetry.sdk._configuration import _OTelSDKConfigurator

from otel_training.resource_info import run_id

METRIC_EXPORT_INTERVAL_MS = "5000"  # 5 s: dashboards see a step-time change quickly


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    environ.setdefault("OTEL_TRACES_EXPORTER", "otlp")
    environ.setdefault("OTEL_METRICS_EXPORTER", "otlp")
    environ.setdefault("OTEL_LOGS_EXPORTER", "none")
    environ.setdefault("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    environ.setdefault("OTEL_METRIC_EXPORT_INTERVAL", METRIC_EXPORT_INTERVAL_MS)
    # Exemplars link histogram buckets to the traces of sampled steps.
    environ.setdefault("OTEL_METRICS_EXEMPLAR_FILTER", "trace_based")
    attrs = environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    present = {kv.split("=", 1)[0].strip() for kv in attrs.split(",") if "=" in kv}
    extra = []
    if "service.instance.id" not in present:
        extra.append(f"service.instance.id={uuid.uuid4()}")
    if "host.name" not in present:
        extra.append(f"host.name={socket.gethostname()}")
    if "training.run.id" not in present:
        extra.append(f"training.run.id={run_id()}")
    if extra:
        environ["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(([attrs] if attrs.strip() else []) + extra)


class TrainingDistro(BaseDistro):
    """``opentelemetry_distro`` entry point: sensible defaults for training jobs."""

    def _configure(self, **kwargs):
        apply_defaults()


class TrainingConfigurator(_OTelSDKConfigurator):
    """``opentelemetry_configurator`` entry point: the SDK's standard set-up."""


def configure_sdk() -> None:
    """Set up the SDK as ``opentelemetry-instrument`` would (used by ``instrument()``)."""
    apply_defaults()
    TrainingConfigurator().configure()
