"""``TrainingInstrumentor``: the OpenTelemetry instrumentor for PyTorch training.

Loaded by ``opentelemetry-instrument`` through the ``opentelemetry_instrumentor``
entry point, or called directly::

    TrainingInstrumentor().instrument()
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from otel_training.config import ConfigError, load_config
from otel_training.package import _instruments
from otel_training.runtime.notice import INTEGRATIONS_FIX, described, not_instrumenting

if TYPE_CHECKING:
    from otel_training.runtime.active import Runtime


class TrainingInstrumentor(BaseInstrumentor):
    """Times every training step by phase; samples hardware into gauges."""

    _runtime: Runtime | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs):
        try:
            config = kwargs.get("config") or load_config()
        except ConfigError as exc:
            # One clear line, then stop: a silently ignored setting is worse.
            from otel_training.distro import stop_on_config_error

            stop_on_config_error(exc)
        if not config.enabled:
            return
        try:
            from otel_training.runtime.active import Runtime
        except Exception as exc:  # torch or one of our dependencies cannot be imported
            not_instrumenting(f"{described(exc)} while importing", "check that `python -c 'import torch'` works")
            return
        tracer_provider = kwargs.get("tracer_provider") or trace.get_tracer_provider()
        meter_provider = kwargs.get("meter_provider") or metrics.get_meter_provider()
        runtime = None
        try:
            runtime = Runtime(config, tracer_provider, meter_provider)
            runtime.install()
        except Exception as exc:  # our bug: the loop runs as it would uninstrumented
            if runtime is not None:
                try:
                    runtime.uninstall()
                except Exception:
                    pass
            not_instrumenting(
                f"setting up failed ({described(exc)})", "training runs uninstrumented; please report this"
            )
            return
        TrainingInstrumentor._runtime = runtime
        try:
            from otel_training import integrations

            runtime.handles.add(integrations.enable(config, runtime))
        except Exception as exc:
            runtime.on_error("integrations", exc)
            not_instrumenting(f"the framework integrations failed to load ({described(exc)})", INTEGRATIONS_FIX)

    def _uninstrument(self, **kwargs):
        runtime = TrainingInstrumentor._runtime
        TrainingInstrumentor._runtime = None
        if runtime is not None:
            runtime.uninstall()  # every handle, the integrations' too
