"""The observable gauges: each callback reports its series' interval values from the Store."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_training.hardware.names import GAUGES
from otel_training.hardware.stats import Store

_logger = logging.getLogger("otel_training.hardware")


def register_gauges(meter: Meter, store: Store, active: Callable[[], bool], names: Sequence[str]) -> list:
    """Create these gauges on ``meter``; series absent from the store are not reported."""
    failed = set()

    def callback_for(name: str):
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            if not active():
                return []
            try:
                return [Observation(value, attrs) for attrs, value in store.collect(name)]
            except Exception:  # never out of a callback (the SDK would log every export)
                if name not in failed:
                    failed.add(name)
                    _logger.warning("reading %s failed", name, exc_info=True)
                return []

        return callback

    return [
        meter.create_observable_gauge(name, callbacks=[callback_for(name)], unit=unit, description=description)
        for name, (unit, description) in ((n, GAUGES[n]) for n in names)
    ]
