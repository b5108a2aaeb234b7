"""Interval statistics: what the sampler writes each tick and the gauges read at export.

A series (metric name + attributes) accumulates samples between two collections;
collecting returns their average and starts a new interval. When nothing arrived
since the previous collection the last known value is returned again, so a slow
source (NVML buffers refresh at most every 1/6 s to 1 s) neither disappears nor
turns into a fake zero.
"""

from __future__ import annotations

import threading
from typing import TypeVar

from opentelemetry.util.types import AttributeValue

Attributes = tuple[tuple[str, AttributeValue], ...]  # sorted, hashable


class Mean:
    """Average of instantaneous samples (utilization, memory, temperature...)."""

    __slots__ = ("_sum", "_count", "_last")

    def __init__(self) -> None:
        self._sum = 0.0
        self._count = 0
        self._last: float | None = None

    def add(self, value: float) -> None:
        self._sum += value
        self._count += 1
        self._last = value

    def collect(self) -> float | None:
        if not self._count:
            return self._last
        value = self._sum / self._count
        self._sum, self._count = 0.0, 0
        return value


class Ratio:
    """Sum of numerators over sum of denominators: a rate from counter deltas
    (delta / elapsed seconds) or a busy share (busy delta / total delta), exact over
    the interval however irregular the ticks were."""

    __slots__ = ("_num", "_den", "_last")

    def __init__(self) -> None:
        self._num = 0.0
        self._den = 0.0
        self._last: float | None = None

    def add(self, numerator: float, denominator: float) -> None:
        if denominator <= 0 or numerator < 0:
            return  # no time elapsed, or a counter reset/wrapped: no information
        self._num += numerator
        self._den += denominator
        self._last = numerator / denominator

    def collect(self) -> float | None:
        if self._den <= 0:
            return self._last
        value = self._num / self._den
        self._num, self._den = 0.0, 0.0
        return value


_Stat = TypeVar("_Stat", Mean, Ratio)


def attributes(**kwargs) -> Attributes:
    return tuple(sorted(kwargs.items()))


class Store:
    """All series, guarded by one lock (the sampler thread writes, the export thread reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[str, dict[Attributes, Mean | Ratio]] = {}  # name -> attributes -> a stat

    def _stat(self, name: str, attrs: Attributes, kind: type[_Stat]) -> _Stat:
        by_attrs = self._series.setdefault(name, {})
        stat = by_attrs.get(attrs)
        if not isinstance(stat, kind):  # new (a series keeps its kind)
            stat = by_attrs[attrs] = kind()
        return stat

    def add(self, name: str, attrs: Attributes, value: float) -> None:
        with self._lock:
            self._stat(name, attrs, Mean).add(float(value))

    def add_ratio(self, name: str, attrs: Attributes, numerator: float, denominator: float) -> None:
        with self._lock:
            self._stat(name, attrs, Ratio).add(float(numerator), float(denominator))

    def drop(self, name: str, match: Attributes | None = None) -> None:
        """Forget a metric's series (all, or those whose attributes include ``match``)."""
        with self._lock:
            by_attrs = self._series.get(name)
            if not by_attrs:
                return
            if match is None:
                by_attrs.clear()
                return
            wanted = set(match)
            for attrs in [a for a in by_attrs if wanted <= set(a)]:
                del by_attrs[attrs]

    def collect(self, name: str) -> list[tuple[dict[str, AttributeValue], float]]:
        """(attributes, interval value) for every series of ``name`` that has a value."""
        out = []
        with self._lock:
            for attrs, stat in self._series.get(name, {}).items():
                value = stat.collect()
                if value is not None:
                    out.append((dict(attrs), value))
        return out
