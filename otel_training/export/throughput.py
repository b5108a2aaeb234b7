"""Tokens, FLOPs and MFU from finished-step records (pipeline thread).

``training.tokens`` and ``training.flops`` are observable counters of the totals so
far, per mode (FLOPs: training steps once their count is known). ``training.mfu``
is an observable gauge: at each collection, the FLOPs of the training steps finished
since the previous collection over their step time, divided by the peak FLOP/s (the
step the FLOPs were counted on, slower, left out, as in the run summary; with
no such step meanwhile, the last value is repeated, as the hardware gauges do); no
point before the first, or without a known peak.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from itertools import groupby
from operator import attrgetter, itemgetter, sub
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, Observation

from otel_training import semconv as sc
from otel_training.export.per_meter import Latest, latest
from otel_training.record.flops import SOURCE_MEASURED

if TYPE_CHECKING:
    from otel_training.aggregate.memory import MemoryTrend
    from otel_training.aggregate.step_record import StepRecord

_MODE = attrgetter("mode")
_TOKENS = attrgetter("tokens")
_TIMES = attrgetter("times")
_FIRST, _LAST = itemgetter(0), itemgetter(-1)


class ThroughputMetrics:
    """A pipeline consumer: ``add(records)``. The instruments of ``meter`` read it from
    now on (``per_meter.py``); its counters go on from the totals of the one before."""

    def __init__(self, meter: Any, common: dict) -> None:
        self._attrs = {mode: {**common, sc.ATTR_MODE: mode} for mode in (sc.MODE_TRAIN, sc.MODE_EVAL)}
        self._lock = threading.Lock()
        self._tokens: dict[str, int] = {}  # per mode, since the start
        self._flops: dict[str, float] = {}
        self._window_flops = 0.0
        self._window_ns = 0
        self._peak: float | None = None
        self._mfu: float | None = None  # the last value: repeated while no step finishes
        self._seen = False  # a step with the FLOP count came (the first is left out of MFU)
        self.memory: Any = None  # the memory instruments made with it (perf_metrics), rebound with it
        slot = latest(meter, "throughput", lambda slot: _create(meter, slot))
        previous = slot.source
        if previous is not None:  # an uninstrument, then instrument again: counters never go back
            with previous._lock:
                self._tokens, self._flops = dict(previous._tokens), dict(previous._flops)
        slot.source = self

    def rebind(self, common: dict) -> None:
        """Report under ``common`` (the rank, once known) from now on."""
        self._attrs = {mode: {**common, sc.ATTR_MODE: mode} for mode in (sc.MODE_TRAIN, sc.MODE_EVAL)}
        if self.memory is not None:
            self.memory.rebind(common)

    def add(self, records: Sequence[StepRecord]) -> None:
        for mode, group in groupby(records, _MODE):
            run = list(group)
            tokens = sum(filter(None, map(_TOKENS, run)))
            count = run[-1].flops
            if count is None:
                if tokens:
                    with self._lock:
                        self._tokens[mode] = self._tokens.get(mode, 0) + tokens
                continue
            # (once known, every training step has it: the usual run needs no filter)
            known = run if run[0].flops is not None else [r for r in run if r.flops is not None]
            flops = count.per_step * len(known)
            timed = known
            if not self._seen:  # the first step with the count is the one it was counted on
                self._seen = True
                if count.source == SOURCE_MEASURED:
                    timed = known[1:]  # it ran slower (FLOP counting): not in MFU
            times = list(map(_TIMES, timed))
            ns = sum(map(sub, map(_LAST, times), map(_FIRST, times)))
            with self._lock:
                if tokens:
                    self._tokens[mode] = self._tokens.get(mode, 0) + tokens
                self._flops[mode] = self._flops.get(mode, 0.0) + flops
                self._window_flops += count.per_step * len(timed)
                self._window_ns += ns
                self._peak = count.peak

    def _observe(self, totals: dict) -> list[Observation]:
        with self._lock:
            items = list(totals.items())
        return [Observation(value, self._attrs.get(mode) or self._attrs[sc.MODE_EVAL]) for mode, value in items]

    def _observe_tokens(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe(self._tokens)

    def _observe_flops(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe(self._flops)

    def _observe_mfu(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            flops, ns, peak = self._window_flops, self._window_ns, self._peak
            self._window_flops, self._window_ns = 0.0, 0
            if ns > 0 and peak:
                self._mfu = flops / (ns / 1e9) / peak
            mfu = self._mfu
        return [Observation(mfu, self._attrs[sc.MODE_TRAIN])] if mfu is not None else []


def _create(meter: Any, slot: Latest[ThroughputMetrics]) -> None:
    # Observable counters: the pipeline only adds to totals; the SDK reads them at
    # collection (no SDK call per batch of steps).
    meter.create_observable_counter(
        sc.METRIC_TOKENS,
        callbacks=[slot.reading(ThroughputMetrics._observe_tokens)],
        unit="{token}",
        description="Token ids processed (padding excluded)",
    )
    meter.create_observable_counter(
        sc.METRIC_FLOPS,
        callbacks=[slot.reading(ThroughputMetrics._observe_flops)],
        unit="{flop}",
        description="Floating-point operations of training steps",
    )
    meter.create_observable_gauge(
        sc.METRIC_MFU,
        callbacks=[slot.reading(ThroughputMetrics._observe_mfu)],
        unit="1",
        description="Model FLOPs utilization: achieved FLOP/s over the device's peak FLOP/s",
    )


def perf_metrics(meter: Any, common: dict, trend: MemoryTrend, memory: bool) -> list:
    """The throughput consumer, and (``memory``) the memory instruments reading ``trend``."""
    from otel_training.export.memory import MemoryMetrics

    throughput = ThroughputMetrics(meter, common)
    if memory:
        throughput.memory = MemoryMetrics(meter, common, trend)
    return [throughput]
