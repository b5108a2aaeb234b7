"""Our own health: internal errors contained, spans/steps dropped, export failures.

Counts are plain integers, bumped under a lock (they are written from the
training thread, the pipeline thread and the SDK's export threads). They are
exported as the ``training.telemetry.*`` observable counters of
docs/telemetry.md ("Self-telemetry") and summarised at run end.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Iterable, Optional

from otel_training import semconv as sc

logger = logging.getLogger("otel_training")

COMPONENT_TRACES = "traces"
COMPONENT_METRICS = "metrics"


class SelfTelemetry:
    def __init__(self) -> None:
        self.errors: Counter = Counter()  # component -> count
        self.export_failures: Counter = Counter()  # "traces" | "metrics" -> count
        self.spans_dropped = 0
        self.steps_dropped = 0
        self.spans_created = 0
        # Re-entrant: a signal handler on the main thread may count while it holds it.
        self._lock = threading.RLock()

    # -- counting ---------------------------------------------------------------------
    def internal_error(self, component: str, exc: Optional[BaseException] = None) -> None:
        """Count a bug of ours that was contained; log the first of each kind."""
        with self._lock:
            self.errors[component] += 1
            first = self.errors[component] == 1
        if first:
            logger.warning(
                "otel-training: internal error in %s (contained; training continues): %r",
                component, exc, exc_info=exc is not None,
            )

    def export_failed(self, component: str, spans: int = 0) -> None:
        """An export of ``component`` (traces or metrics) failed; ``spans`` were lost with it."""
        with self._lock:
            self.export_failures[component] += 1
            self.spans_dropped += spans

    def drop_spans(self, count: int) -> None:
        """Spans the SDK's span queue refused (full) or that could not be exported."""
        if count > 0:
            with self._lock:
                self.spans_dropped += count

    # -- reading ----------------------------------------------------------------------
    def as_dict(self) -> dict:
        return {
            "spans_dropped": self.spans_dropped,
            "steps_dropped": self.steps_dropped,
            "export_failures": sum(self.export_failures.values()),
            "errors": sum(self.errors.values()),
        }

    def register(self, meter, attributes: Optional[dict] = None) -> None:
        """Export the counts as the observable counters of the contract.

        ``attributes`` (host, rank) go on every point, so that ranks sharing a
        resource stay distinct series. Callbacks only read integers.
        """
        common = dict(attributes or {})

        def _one(value_of):
            def callback(options) -> Iterable:
                from opentelemetry.metrics import Observation

                return [Observation(value_of(), common)]
            return callback

        def _by_component(counter: Counter, always: tuple):
            def callback(options) -> Iterable:
                from opentelemetry.metrics import Observation

                with self._lock:
                    items = dict(counter)
                for name in always:
                    items.setdefault(name, 0)
                return [Observation(n, {**common, sc.ATTR_COMPONENT: c}) for c, n in sorted(items.items())]
            return callback

        meter.create_observable_counter(
            sc.METRIC_SPANS_DROPPED, callbacks=[_one(lambda: self.spans_dropped)], unit="{span}",
            description="Spans lost: refused by the full span queue or in a failed export")
        meter.create_observable_counter(
            sc.METRIC_STEPS_DROPPED, callbacks=[_one(lambda: self.steps_dropped)], unit="{step}",
            description="Finished steps dropped because the pipeline fell behind")
        meter.create_observable_counter(
            sc.METRIC_EXPORT_FAILURES,
            callbacks=[_by_component(self.export_failures, (COMPONENT_TRACES, COMPONENT_METRICS))],
            unit="{failure}", description="Failed OTLP exports, by signal")
        meter.create_observable_counter(
            sc.METRIC_INTERNAL_ERRORS, callbacks=[_by_component(self.errors, ())], unit="{error}",
            description="Errors inside otel-training, contained (training continued)")
