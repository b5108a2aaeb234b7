"""The active instrumentation: config, tracker, hooks, pipeline, hardware.

One Runtime per process, created by the instrumentor; ``current()`` finds it
(the manual API and framework integrations use it).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import Any, Optional

from otel_training import semconv as sc
from otel_training.capture import TailCapture
from otel_training.config import Config
from otel_training.emit.metrics import StepMetrics
from otel_training.pipeline import Pipeline
from otel_training.resource_info import process_info, run_id
from otel_training.selftelemetry import SelfTelemetry
from otel_training.summary import RunSummary, render, write
from otel_training.tracker import Tracker
from otel_training.version import __version__

logger = logging.getLogger("otel_training")
_CURRENT: Optional["Runtime"] = None


def current() -> Optional["Runtime"]:
    return _CURRENT


def _service_name(tracer_provider) -> str:
    resource = getattr(tracer_provider, "resource", None)
    if resource is not None:
        name = resource.attributes.get("service.name")
        if name:
            return str(name)
    return os.environ.get("OTEL_SERVICE_NAME", "unknown_service")


class Runtime:
    def __init__(self, config: Config, tracer_provider, meter_provider) -> None:
        from otel_training.device_timing import make_timer

        self.config = config
        self.telemetry = SelfTelemetry()
        self.info = process_info()
        self.timer = make_timer(config.gpu_timing)
        tracer = tracer_provider.get_tracer(sc.SCOPE, __version__)
        meter = meter_provider.get_meter(sc.SCOPE, __version__)
        common = self.info.metric_attributes()
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        summary_info = {
            "service": _service_name(tracer_provider), "run_id": run_id(), "host": self.info.host_name,
            "rank": self.info.rank, "world_size": self.info.world_size, "pid": os.getpid(),
        }
        self.pipeline = Pipeline(
            tracer=tracer,
            metrics=StepMetrics(meter, common),
            capture=TailCapture(config.trace_slow_factor, config.trace_every_n, config.trace_max_per_second),
            summary=RunSummary(summary_info, self.timer.mode),
            timer=self.timer,
            telemetry=self.telemetry,
            span_attributes=common,
        )
        self.tracker = Tracker(self._on_step, self.timer)
        self.module_hooks = None
        self._handles: list = []
        self._patcher = None
        self.hardware = None
        self._closed = False
        self._lock = threading.Lock()

    # -- wiring -------------------------------------------------------------------------
    def _on_step(self, step) -> None:
        self.pipeline.submit(step)
        hooks = self.module_hooks
        if hooks is not None:
            hooks.on_step_end()

    def on_error(self, component: str, exc: BaseException) -> None:
        self.telemetry.internal_error(component, exc)

    def install(self) -> None:
        from otel_training.hooks.modules import RootModuleHooks
        from otel_training.hooks.patching import Patcher
        from otel_training.hooks.torch_hooks import install_torch_hooks

        self._patcher = Patcher()
        self.module_hooks = RootModuleHooks(self.tracker, self.on_error)
        self.module_hooks.arm()
        self._handles = install_torch_hooks(self.tracker, self._patcher, self.on_error)
        self.pipeline.start()
        if self.config.hardware:
            try:
                from otel_training.hardware import start_hardware_metrics

                self.hardware = start_hardware_metrics(
                    self.meter_provider, self.config, host_name=self.info.host_name)
            except Exception as exc:
                self.on_error("hardware", exc)
        global _CURRENT
        _CURRENT = self
        atexit.register(self.shutdown)

    def uninstall(self) -> None:
        """Remove every hook and patch (exact restore); telemetry so far is flushed."""
        self.shutdown()
        if self.module_hooks is not None:
            self.module_hooks.remove()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._patcher is not None:
            self._patcher.undo()
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None
        try:
            atexit.unregister(self.shutdown)
        except Exception:  # pragma: no cover
            pass

    # -- end of run -------------------------------------------------------------------------
    def summary_dict(self) -> dict:
        return self.pipeline.summary.to_dict(self.telemetry.as_dict())

    def shutdown(self) -> None:
        """End the open step, flush the pipeline (bounded), print/write the summary."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self.tracker.step is not None:
                exc = sys.exc_info()[1] if sys.exc_info()[0] not in (None, SystemExit) else None
                self.tracker.finish_step(exc)
        except Exception as exc:
            self.on_error("shutdown", exc)
        budget = self.config.shutdown_timeout
        self.pipeline.stop(budget * 0.5)
        if self.hardware is not None:
            try:
                self.hardware.shutdown(min(1.0, budget * 0.25))
            except Exception as exc:
                self.on_error("hardware", exc)
        try:
            summary = self.summary_dict()
            if self.config.summary and summary["modes"]:
                print(render(summary), file=sys.stderr, flush=True)
            if self.config.summary_file:
                write(summary, self.config.summary_file)
        except OSError as exc:
            print(f"otel-training: cannot write {self.config.summary_file!r} "
                  f"(OTEL_TRAINING_SUMMARY_FILE): {exc.strerror}", file=sys.stderr)
        except Exception as exc:
            self.on_error("summary", exc)
