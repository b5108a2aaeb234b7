"""The process's wall time by activity, and goodput, as observable instruments.

``training.job.time`` (counter, s, ``training.activity``): the seconds of each
activity so far (aggregate/job.py), read from the ``JobClock`` at each collection,
and ``restart``: the time between a restarted run's previous attempt and this process
(runtime/attempts.py);
``training.goodput`` (gauge, 1): train time over the wall time accounted so far.
Nothing is reported before the first step (start-up is known once it has ended, so
its whole value arrives at once and a windowed ``rate()`` never counts a run's
start-up). A counter never goes down: an activity that a named phase later claims
time from (it held steps) keeps the value it reported.

As with ``training.phase.open.duration``, the SDK keeps the first callback registered
under a name on a meter: the instruments are made once per meter and read whichever
clock registered last (held weakly).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from otel_training import semconv as sc


class _Observed:
    def __init__(self) -> None:
        self.clock: weakref.ref | None = None
        self.attributes: dict = {}
        self.on_error: Callable[[str, BaseException], None] | None = None
        self._reported: dict[str, float] = {}  # activity -> the highest value reported
        self._by_activity: dict[str, dict] = {}

    def use(self, clock: Any, attributes: dict, on_error: Callable[[str, BaseException], None] | None) -> None:
        self.clock = weakref.ref(clock)
        self.attributes = dict(attributes)
        self.on_error = on_error
        self._reported = {}
        self._by_activity = {}

    def _totals(self, restart: bool = False) -> dict[str, float] | None:
        """Seconds by activity; with ``restart``, the gap before this attempt of a
        restarted run too (not the process's own time: no part of its goodput)."""
        clock = self.clock() if self.clock is not None else None
        if clock is None or not clock.started_steps():
            return None
        totals = clock.totals()
        if restart and clock.restart_s > 0:
            totals[sc.ACTIVITY_RESTART] = clock.restart_s
        return totals

    def time(self, options: Any) -> Iterable:
        from opentelemetry.metrics import Observation

        try:
            totals = self._totals(restart=True)
            if not totals:
                return []
            out = []
            reported = self._reported
            for activity, seconds in totals.items():
                value = max(seconds, reported.get(activity, 0.0))
                reported[activity] = value
                attrs = self._by_activity.get(activity)
                if attrs is None:
                    attrs = self._by_activity[activity] = {**self.attributes, sc.ATTR_ACTIVITY: activity}
                out.append(Observation(value, attrs))
            return out
        except Exception as exc:  # our bug: counted, and no point this export
            if self.on_error is not None:
                self.on_error("metrics", exc)
            return []

    def goodput(self, options: Any) -> Iterable:
        from opentelemetry.metrics import Observation

        try:
            totals = self._totals()
            wall = sum(totals.values()) if totals else 0.0
            if not totals or wall <= 0:
                return []
            return [Observation(totals.get(sc.MODE_TRAIN, 0.0) / wall, self.attributes)]
        except Exception as exc:
            if self.on_error is not None:
                self.on_error("metrics", exc)
            return []


_OBSERVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # meter -> _Observed


def register(
    meter: Any,
    clock: Any,
    attributes: dict | None = None,
    on_error: Callable[[str, BaseException], None] | None = None,
) -> None:
    """Export ``training.job.time`` and ``training.goodput`` of ``clock`` on ``meter``
    (with the common attributes: host, rank)."""
    observed = _OBSERVED.get(meter)
    if observed is None:
        observed = _OBSERVED[meter] = _Observed()
        meter.create_observable_counter(
            sc.METRIC_JOB_TIME,
            callbacks=[observed.time],
            unit="s",
            description="Wall time of the process by activity (startup, compile, train, eval, checkpoint, "
            "named phases between steps, other, shutdown)",
        )
        meter.create_observable_gauge(
            sc.METRIC_GOODPUT,
            callbacks=[observed.goodput],
            unit="1",
            description="Goodput: time in train steps over the process's wall time so far",
        )
    observed.use(clock, attributes or {}, on_error)
