"""Our own health: internal errors contained, spans/steps dropped, export failures.

Counts are plain integers (cheap, thread-safe enough under the GIL for counters
that only grow); they are exported as the ``training.telemetry.*`` counters and
summarised at run end.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Optional

logger = logging.getLogger("otel_training")


class SelfTelemetry:
    def __init__(self) -> None:
        self.errors: Counter = Counter()  # component -> count
        self.export_failures: Counter = Counter()  # "traces" | "metrics" -> count
        self.spans_dropped = 0
        self.steps_dropped = 0
        self.spans_created = 0

    def internal_error(self, component: str, exc: Optional[BaseException] = None) -> None:
        """Count a bug of ours that was contained; log the first of each kind."""
        self.errors[component] += 1
        if self.errors[component] == 1:
            logger.warning(
                "otel-training: internal error in %s (contained; training continues): %r",
                component, exc, exc_info=exc is not None,
            )

    def as_dict(self) -> dict:
        return {
            "spans_dropped": self.spans_dropped,
            "steps_dropped": self.steps_dropped,
            "export_failures": sum(self.export_failures.values()),
            "errors": sum(self.errors.values()),
        }
