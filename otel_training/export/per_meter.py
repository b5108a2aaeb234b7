"""Observable instruments made once per meter, read from the source registered last.

The SDK gives the same meter back for the same scope and keeps the first callbacks
registered under an instrument name on it: instruments made again after an
uninstrument and instrument would never be read, and the first run's would report
for ever. So each kind of instrument is made once per meter, and its callbacks read
whichever source (a ``MemoryMetrics``, a ``ThroughputMetrics``) registered last.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

S = TypeVar("S")

_BY_METER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # meter -> {kind: Latest}


class Latest(Generic[S]):
    """The source the instruments of one kind on one meter read."""

    def __init__(self) -> None:
        self.source: S | None = None

    def reading(self, read: Callable[[S, Any], Iterable]) -> Callable[[Any], Iterable]:
        """A callback: ``read(source, options)`` for the current source (nothing before one)."""

        def callback(options: Any) -> Iterable:
            source = self.source
            return read(source, options) if source is not None else []

        return callback


def latest(meter: Any, kind: str, create: Callable[[Latest], None]) -> Latest:
    """The ``kind`` instruments' ``Latest`` on ``meter``; ``create(latest)`` makes the
    instruments the first time."""
    kinds = _BY_METER.get(meter)
    if kinds is None:
        kinds = _BY_METER[meter] = {}
    found = kinds.get(kind)
    if found is None:
        found = kinds[kind] = Latest()
        create(found)
    return found
