"""Our own health: internal errors contained, spans/steps dropped, export failures.

Counts are plain integers, bumped under a lock (they are written from the
training thread, the pipeline thread and the SDK's export threads). They are
exported as the ``training.telemetry.*`` observable counters of
docs/telemetry.md ("Self-telemetry") and summarised at run end.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter
from collections.abc import Iterable

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
        # Re-entrant: a signal handler on the main thread may count while it holds it.
        self._lock = threading.RLock()

    # -- counting ---------------------------------------------------------------------
    def internal_error(self, component: str, exc: BaseException | None = None, *, said: bool = False) -> None:
        """Count a bug of ours that was contained; log the first of each kind (unless
        ``said``: the caller has told the user in its own line)."""
        with self._lock:
            self.errors[component] += 1
            first = self.errors[component] == 1
        if first and not said:
            logger.warning(
                "otel-training: internal error in %s (contained; training continues): %r",
                component,
                exc,
                exc_info=exc is not None,
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

    def drop_steps(self, count: int) -> None:
        """Finished steps we could not process (the pipeline fell behind)."""
        if count > 0:
            with self._lock:
                self.steps_dropped += count

    def after_fork(self) -> None:
        """In a forked child: a lock a parent thread held at the fork stays held here."""
        self._lock = threading.RLock()

    # -- reading ----------------------------------------------------------------------
    def as_dict(self) -> dict:
        return {
            "spans_dropped": self.spans_dropped,
            "steps_dropped": self.steps_dropped,
            "export_failures": sum(self.export_failures.values()),
            "errors": sum(self.errors.values()),
        }

    def register(self, meter, attributes: dict | None = None) -> None:
        """Export the counts as the observable counters of the contract.

        ``attributes`` (host, rank) go on every point, so that ranks sharing a
        resource stay distinct series. The SDK keeps the first callbacks registered
        under a name on a meter, so the instruments are created once per meter and
        read whichever SelfTelemetry registered last; counts of earlier ones (an
        uninstrument, then instrument again) stay in, so the counters never go back.
        """
        exported = _EXPORTED.get(meter)
        if exported is None:
            exported = _EXPORTED[meter] = _Exported()
            exported.create_instruments(meter)
        exported.switch_to(self, dict(attributes or {}))


class _Exported:
    """What the self-telemetry instruments of one meter report."""

    def __init__(self) -> None:
        self.current: SelfTelemetry | None = None
        self.attributes: dict = {}
        self.retired = {"spans_dropped": 0, "steps_dropped": 0}
        self.retired_failures: Counter = Counter()
        self.retired_errors: Counter = Counter()

    def switch_to(self, telemetry: SelfTelemetry, attributes: dict) -> None:
        old = self.current
        if old is not None and old is not telemetry:
            with old._lock:
                self.retired["spans_dropped"] += old.spans_dropped
                self.retired["steps_dropped"] += old.steps_dropped
                self.retired_failures.update(old.export_failures)
                self.retired_errors.update(old.errors)
        self.current = telemetry
        self.attributes = attributes

    def _scalar(self, name: str):
        def callback(options) -> Iterable:
            from opentelemetry.metrics import Observation

            current = self.current
            value = self.retired[name] + (getattr(current, name) if current is not None else 0)
            return [Observation(value, self.attributes)]

        return callback

    def _by_component(self, field: str, retired: Counter, always: tuple):
        def callback(options) -> Iterable:
            from opentelemetry.metrics import Observation

            items = Counter(retired)
            current = self.current
            if current is not None:
                with current._lock:
                    items.update(getattr(current, field))
            for name in always:
                items.setdefault(name, 0)
            return [Observation(n, {**self.attributes, sc.ATTR_COMPONENT: c}) for c, n in sorted(items.items())]

        return callback

    def create_instruments(self, meter) -> None:
        meter.create_observable_counter(
            sc.METRIC_SPANS_DROPPED,
            callbacks=[self._scalar("spans_dropped")],
            unit="{span}",
            description="Spans lost: refused by the full span queue or in a failed export",
        )
        meter.create_observable_counter(
            sc.METRIC_STEPS_DROPPED,
            callbacks=[self._scalar("steps_dropped")],
            unit="{step}",
            description="Finished steps dropped because the pipeline fell behind",
        )
        meter.create_observable_counter(
            sc.METRIC_EXPORT_FAILURES,
            callbacks=[
                self._by_component("export_failures", self.retired_failures, (COMPONENT_TRACES, COMPONENT_METRICS))
            ],
            unit="{failure}",
            description="Failed OTLP exports, by signal",
        )
        meter.create_observable_counter(
            sc.METRIC_INTERNAL_ERRORS,
            callbacks=[self._by_component("errors", self.retired_errors, ())],
            unit="{error}",
            description="Errors inside otel-training, contained (training continued)",
        )


_EXPORTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # meter -> _Exported
