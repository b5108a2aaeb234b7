"""The observable gauges: each callback reports its series' interval values from the Store.

The SDK gives the same meter back for the same scope and keeps an instrument's first
callbacks, so each gauge is made once per meter and reads the store of the hardware
metrics started last on it (while they are active): after an uninstrument and
instrument again on the same providers, the new sampler's values go out.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Sequence

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_training.hardware.names import GAUGES
from otel_training.hardware.stats import Store

_logger = logging.getLogger("otel_training.hardware")

Source = tuple[Store, Callable[[], bool]]  # the store read, while ``active()``

_BY_METER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # meter -> {gauge name: [Source]}


def register_gauges(meter: Meter, store: Store, active: Callable[[], bool], names: Sequence[str]) -> None:
    """These gauges of ``meter`` read ``store`` from now on, while ``active()``; series
    absent from the store are not reported."""
    sources = _BY_METER.get(meter)
    if sources is None:
        sources = _BY_METER[meter] = {}
    for name in names:
        current = sources.get(name)
        if current is not None:  # made by an earlier start on this meter
            current[0] = (store, active)
            continue
        current = sources[name] = [(store, active)]
        unit, description = GAUGES[name]
        meter.create_observable_gauge(name, callbacks=[_callback(name, current)], unit=unit, description=description)


def _callback(name: str, current: list[Source]) -> Callable[[CallbackOptions], Iterable[Observation]]:
    failed = False

    def callback(options: CallbackOptions) -> Iterable[Observation]:
        nonlocal failed
        store, active = current[0]
        if not active():
            return []
        try:
            return [Observation(value, attrs) for attrs, value in store.collect(name)]
        except Exception:  # never out of a callback (the SDK would log every export)
            if not failed:
                failed = True
                _logger.warning("reading %s failed", name, exc_info=True)
            return []

    return callback
