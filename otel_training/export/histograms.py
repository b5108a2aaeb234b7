"""Step and phase histograms binned here and merged into the SDK's collections.

The SDK's ``Histogram.record()`` copies, validates and hashes the attributes on
every call (about 6 µs); at one record per phase per step that was the largest
cost of instrumenting short steps. Our series are few and fixed, so the pipeline
bins each value itself (a bisect and a few adds) and every SDK metric reader gets
the points added to its collection, with the reader's temporality, as the SDK would
export them: same names, units, buckets, exemplars and scope.

Only where that is exact: an SDK ``MeterProvider`` without views, whose readers all
use the default histogram aggregation. Anywhere else ``attach`` says no and the
caller records through the SDK instruments.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from functools import reduce
from operator import add
from typing import Any

from otel_training.export import sdk

_INF = float("inf")


_BIN_EVERY = 512  # bounds the values queued per series


def _bin(bounds: tuple, s: Series) -> None:
    """Bin ``s.pending`` into ``s``, in order (with the bank's lock held). The
    list stays the same object and is cut, not swapped: a value appended meanwhile
    by the pipeline (``Series.pending.append`` needs no lock) stays queued."""
    pending = s.pending
    n = len(pending)
    values = pending[:n]
    del pending[:n]
    counts = s.counts
    # Sorted once, each bucket's count is a difference of two bisections: C-level
    # loops, where a Python loop per value cost more than the rest of the
    # pipeline's work per step. The sum goes in arrival order, as the SDK's does.
    ordered = sorted(values)
    below = 0
    for i, bound in enumerate(bounds):
        upto = bisect_right(ordered, bound, below)  # value <= bound: bucket i, as bisect_left(bounds, value)
        if upto != below:
            counts[i] += upto - below
            below = upto
    if below < n:
        counts[-1] += n - below
    s.sum = reduce(add, values, s.sum)
    s.count += n
    lo, hi = ordered[0], ordered[-1]
    if lo < s.min:
        s.min = lo
    if hi > s.max:
        s.max = hi
    for w in s.windows:
        if lo < w[0]:
            w[0] = lo
        if hi > w[1]:
            w[1] = hi


class Series:
    """One attribute set of one histogram: cumulative since the bank started."""

    __slots__ = ("attributes", "counts", "sum", "count", "min", "max", "exemplars", "windows", "pending")

    def __init__(self, attributes: dict, buckets: int) -> None:
        self.attributes = attributes
        self.counts = [0] * buckets
        self.sum = 0.0
        self.count = 0
        self.min = _INF
        self.max = -_INF
        self.exemplars: dict[int, tuple] = {}  # bucket -> (seq, Exemplar)
        self.windows: list[list] = []  # [min, max] since each delta reader's last collection
        self.pending: list[float] = []  # values not binned yet (see HistogramBank.add_all)


class FastHistogram:
    """An explicit-bucket histogram instrument; ``series(attrs)`` once per attribute set."""

    def __init__(self, bank: HistogramBank, name: str, unit: str, description: str) -> None:
        self.bank = bank
        self.name = name
        self.unit = unit
        self.description = description
        self._series: dict[tuple, Series] = {}

    def series(self, attributes: dict) -> Series:
        """The series for ``attributes``; call with ``bank.lock`` held."""
        key = tuple(sorted(attributes.items()))
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = Series(dict(attributes), len(self.bank.bounds) + 1)
            s.windows = [[_INF, -_INF] for _ in range(self.bank.delta_readers)]
        return s


class _Reader:
    __slots__ = ("original", "delta", "window", "last_ns", "prev", "exemplar_seq")

    def __init__(self, original: Callable, delta: bool, window: int, start_ns: int) -> None:
        self.original = original  # the reader's own collection
        self.delta = delta
        self.window = window  # index into Series.windows (delta readers)
        self.last_ns = start_ns
        self.prev: dict[int, tuple] = {}  # id(series) -> (counts, sum, count) at the last delta collection
        self.exemplar_seq = 0


_BANKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BANKS_LOCK = threading.Lock()


def bank_for(
    meter_provider: Any,
    instrument_class: type,
    scope_name: str,
    scope_version: str,
    bounds: Sequence[float],
    on_error: Callable[[BaseException], None] | None = None,
) -> HistogramBank | None:
    """The provider's bank (one per provider and scope, kept across re-instrumentation,
    as the SDK keeps an instrument), or None where the SDK must record itself.
    ``instrument_class``: the class of the SDK histogram this bank stands in for."""
    key = (scope_name, scope_version, tuple(bounds))
    with _BANKS_LOCK:
        try:
            banks = _BANKS.setdefault(meter_provider, {})
        except TypeError:  # not weak-referenceable: not the SDK's provider
            return None
        bank = banks.get(key)
        if bank is None:
            bank = HistogramBank(scope_name, scope_version, bounds)
            if not bank.attach(meter_provider, instrument_class):
                return None
            banks[key] = bank
    bank.on_error = on_error
    return bank


def _reinit_lock(ref: weakref.ref) -> None:
    bank = ref()
    if bank is not None:
        bank.lock = threading.Lock()


class HistogramBank:
    """Histograms of one instrumentation scope, exported through every SDK reader."""

    def __init__(
        self,
        scope_name: str,
        scope_version: str,
        bounds: Sequence[float],
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.scope_name = scope_name
        self.scope_version = scope_version
        self.bounds = tuple(float(b) for b in bounds)
        self.lock = threading.Lock()
        self.histograms: list[FastHistogram] = []
        self.delta_readers = 0
        self.exemplars_on = True
        self._readers: list[_Reader] = []
        self._resource: Any = None
        self._start_ns = time.time_ns()
        self._seq = 0
        self._deferred = 0  # add_all calls since the pending values were last binned
        self.on_error = on_error
        # A fork (a DataLoader worker) may happen while the pipeline holds the lock;
        # the child's copy would then never be released, and the SDK collects at exit.
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _reinit_lock(ref))

    def histogram(self, name: str, unit: str, description: str) -> FastHistogram:
        """The instrument called ``name`` (created once, like the SDK's)."""
        for h in self.histograms:
            if h.name == name:
                return h
        h = FastHistogram(self, name, unit, description)
        self.histograms.append(h)
        return h

    # -- recording (pipeline thread, under ``lock``) ------------------------------------
    def add(self, s: Series, value: float, exemplar: tuple | None = None) -> None:
        """Count ``value`` in ``s``; ``exemplar``: (trace_id, span_id, time_ns) of a sampled span."""
        s.pending.append(value)  # after the queued ones: sums in order, as the SDK's
        _bin(self.bounds, s)
        if exemplar is not None and self.exemplars_on:
            i = bisect_left(self.bounds, value)
            from opentelemetry.sdk.metrics import Exemplar

            self._seq += 1
            trace_id, span_id, at = exemplar
            s.exemplars[i] = (self._seq, Exemplar({}, value, at, span_id, trace_id))

    def add_all(self, values: list[tuple[Series, float]], exemplar: tuple | None = None) -> None:
        """``add`` for each ``(series, value)`` (one step's values). Without an
        exemplar the values are only queued: binning them in bulk, at collection or
        every _BIN_EVERY calls, costs the pipeline a fraction of binning each."""
        if exemplar is not None and self.exemplars_on:
            for s, value in values:
                self.add(s, value, exemplar)
            return
        for s, value in values:
            s.pending.append(value)
        self._deferred += 1
        if self._deferred >= _BIN_EVERY:
            self.bin_pending()

    def queued(self, steps: int) -> None:
        """``steps`` more steps were queued straight into ``Series.pending``
        (call with ``lock`` held): bins them once enough have gathered."""
        self._deferred += steps
        if self._deferred >= _BIN_EVERY:
            self.bin_pending()

    def bin_pending(self) -> None:
        """Bin every queued value (call with ``lock`` held)."""
        self._deferred = 0
        bounds = self.bounds
        for h in self.histograms:
            for s in h._series.values():
                if s.pending:
                    _bin(bounds, s)

    # -- wiring into the SDK --------------------------------------------------------------
    def attach(self, meter_provider: Any, instrument_class: type) -> bool:
        """Merge our points into each reader's collections; False (nothing changed)
        where that would not be exactly what the SDK itself would export."""
        try:
            from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter
            from opentelemetry.sdk.metrics.export import AggregationTemporality
        except ImportError:  # pragma: no cover - the SDK ships with the package
            return False
        config = sdk.meter_config(meter_provider)
        if config is None or getattr(config, "views", None):
            return False  # not the SDK's provider, or a view may rename, drop or rebucket
        readers = sdk.metric_readers(meter_provider)
        if not readers:
            return False
        plans = []
        for reader in readers:
            # Keyed by the SDK's instrument classes: an instrument of any other meter
            # (the API's no-op one) finds nothing here.
            plan = sdk.reader_histogram_plan(reader, instrument_class)
            if plan is None or not self._same_buckets(plan[2]):
                return False
            collect, temporality, _ = plan
            plans.append((reader, collect, temporality == AggregationTemporality.DELTA))
        self._resource = getattr(config, "resource", None)
        self.exemplars_on = not isinstance(getattr(config, "exemplar_filter", None), AlwaysOffExemplarFilter)
        for reader, collect, delta in plans:
            state = _Reader(collect, delta, self.delta_readers if delta else -1, self._start_ns)
            if delta:
                self.delta_readers += 1
            self._readers.append(state)
            sdk.replace_collect(reader, self._collector(state))
        return True

    def _same_buckets(self, aggregation: Any) -> bool:
        """Whether the reader's histogram aggregation yields our buckets, with min/max:
        the default, or explicit buckets deferring to the instrument's advice (what
        the OTLP exporters prefer) or naming the same boundaries."""
        from opentelemetry.sdk.metrics.view import DefaultAggregation

        if type(aggregation) is DefaultAggregation:
            return True
        explicit = sdk.explicit_buckets(aggregation)
        if explicit is None:
            return False
        bounds, min_max = explicit
        return min_max and (bounds is None or tuple(float(b) for b in bounds) == self.bounds)

    def _collector(self, state: _Reader) -> Callable:
        bank = self

        def collect(reader: Any, *args: Any, **kwargs: Any) -> Any:
            data = state.original(reader, *args, **kwargs)
            try:
                return bank._merge(state, data)
            except Exception as exc:  # our bug: the SDK's own data still goes out
                if bank.on_error is not None:
                    bank.on_error(exc)
                return data

        return collect

    # -- collection (the reader's thread) ------------------------------------------------
    def _merge(self, state: _Reader, data: Any) -> Any:
        metrics = self.collect(state)
        if not metrics:
            return data
        from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        if data is None or not data.resource_metrics:
            resource = self._resource
            if resource is None:
                return data
            scope = InstrumentationScope(self.scope_name, self.scope_version)
            return MetricsData([ResourceMetrics(resource, [ScopeMetrics(scope, metrics, "")], "")])
        first, *rest = data.resource_metrics
        scopes = list(first.scope_metrics)
        for i, sm in enumerate(scopes):
            if sm.scope.name == self.scope_name and sm.scope.version == self.scope_version:
                scopes[i] = dataclasses.replace(sm, metrics=list(sm.metrics) + metrics)
                break
        else:
            scopes.append(ScopeMetrics(InstrumentationScope(self.scope_name, self.scope_version), metrics, ""))
        return dataclasses.replace(data, resource_metrics=[dataclasses.replace(first, scope_metrics=scopes)] + rest)

    def collect(self, state: _Reader) -> list:
        """This reader's ``Metric``s since its last collection (delta) or since the start."""
        from opentelemetry.sdk.metrics.export import AggregationTemporality, HistogramDataPoint, Metric
        from opentelemetry.sdk.metrics.export import Histogram as HistogramData

        now = time.time_ns()
        bounds = list(self.bounds)
        out = []
        with self.lock:
            self.bin_pending()
            seq = state.exemplar_seq
            for h in self.histograms:
                points = []
                for s in h._series.values():
                    exemplars = [e for n, e in s.exemplars.values() if n > seq]
                    if state.delta:
                        counts, total, count = s.counts, s.sum, s.count
                        prev = state.prev.get(id(s))
                        if prev is not None:
                            counts = [a - b for a, b in zip(counts, prev[0])]
                            total, count = total - prev[1], count - prev[2]
                        state.prev[id(s)] = (list(s.counts), s.sum, s.count)
                        window = s.windows[state.window]
                        lo, hi = window
                        window[0], window[1] = _INF, -_INF
                        if not count:
                            continue
                        start = state.last_ns
                    else:
                        if not s.count:
                            continue
                        counts, total, count, lo, hi, start = (
                            list(s.counts),
                            s.sum,
                            s.count,
                            s.min,
                            s.max,
                            self._start_ns,
                        )
                    points.append(
                        HistogramDataPoint(
                            attributes=dict(s.attributes),
                            start_time_unix_nano=start,
                            time_unix_nano=now,
                            count=count,
                            sum=total,
                            bucket_counts=counts,
                            explicit_bounds=bounds,
                            min=lo,
                            max=hi,
                            exemplars=exemplars,
                        )
                    )
                if points:
                    temporality = AggregationTemporality.DELTA if state.delta else AggregationTemporality.CUMULATIVE
                    out.append(
                        Metric(
                            name=h.name,
                            description=h.description,
                            unit=h.unit,
                            data=HistogramData(data_points=points, aggregation_temporality=temporality),
                        )
                    )
            state.exemplar_seq = self._seq
        state.last_ns = now
        return out
