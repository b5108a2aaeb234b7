"""Untraced steps grouped by shape, their phase times added column by column.

Most steps of a loop have the same *shape*: the same phases, nested the same way,
starting and ending at the same mark indices. For such a step the pipeline keeps
only its marks; at the end of each batch every phase's times for all the steps
of a shape are computed, summed and queued for binning in C-level loops
(``map``, ``sum``) rather than a Python loop per phase per step, which was most
of the pipeline's cost at short steps. What comes out is the same as processing
each step alone: the same summary totals and the same histogram values.

Steps that are traced, carry GPU times, or have a shape not seen before once
``_MAX_SHAPES`` are known go through the pipeline's per-step path.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, itemgetter, sub, truediv
from typing import Any, Callable, Dict, List, Optional, Tuple

from otel_training import semconv as sc

_MAX_SHAPES = 64  # per mode: a loop whose shape keeps changing gains nothing here
_SHAPE = attrgetter("name", "parent", "start", "end")
_FIRST, _LAST = itemgetter(0), itemgetter(-1)
_NS = repeat(1e9)


class _Shape:
    """One step shape: per phase slot, the (start, end) mark indices to sum; the
    top-level ones (whose sum is the tracked time); the marks of its steps."""

    __slots__ = ("slots", "top", "rows")

    def __init__(self, slots: List[Tuple[Any, List[Tuple[int, int]]]], top: List[Tuple[int, int]]) -> None:
        self.slots = slots
        self.top = top
        self.rows: List[list] = []


def _column(rows: List[list], spans: List[Tuple[int, int]]) -> List[int]:
    """Per row, the summed durations of ``spans`` (pairs of mark indices)."""
    col: Optional[List[int]] = None
    for start, end in spans:
        c = list(map(sub, map(itemgetter(end), rows), map(itemgetter(start), rows)))
        col = c if col is None else list(map(int.__add__, col, c))
    return col if col is not None else [0] * len(rows)


class Shapes:
    """Steps queued by shape; ``flush`` adds them to their phase slots.

    ``slot_for(mode, name, parent)``: the pipeline's ``_PhaseSlot`` (its
    ``totals`` and ``queue``); ``step_queue(mode)``: where step durations go.
    """

    def __init__(self, slot_for: Callable[[str, str, str], Any], step_queue: Callable[[str], list]) -> None:
        self._slot_for = slot_for
        self._step_queue = step_queue
        self._shapes: Dict[str, Dict[tuple, Optional[_Shape]]] = {}
        self._pending: List[Tuple[str, _Shape]] = []  # shapes with rows, in first-use order

    def add(self, mode: str, phases: list, times: list) -> bool:
        """Queue one untraced step; False if its shape is not handled here."""
        shapes = self._shapes.get(mode)
        if shapes is None:
            shapes = self._shapes[mode] = {}
        key = tuple(map(_SHAPE, phases))
        shape = shapes.get(key, False)
        if shape is False:
            if len(shapes) >= _MAX_SHAPES:
                return False  # not remembered: the table stays bounded
            shape = shapes[key] = self._new(mode, phases)
        if shape is None:
            return False
        rows = shape.rows
        if not rows:
            self._pending.append((mode, shape))
        rows.append(times)
        return True

    def _new(self, mode: str, phases: list) -> Optional[_Shape]:
        # parent == "step" means top-level only while no phase is itself named so
        # (the key holds parents' names, not the records).
        if any(rec.name == sc.SPAN_STEP for rec in phases):
            return None
        spans: Dict[Tuple[str, str], List[Tuple[int, int]]] = {}
        top = []
        for rec in phases:
            if rec.end < 0:
                continue
            spans.setdefault((rec.name, rec.parent), []).append((rec.start, rec.end))
            if rec.up is None:
                top.append((rec.start, rec.end))
        slots = [(self._slot_for(mode, name, parent), s) for (name, parent), s in spans.items()]
        return _Shape(slots, top)

    def flush(self) -> None:
        """Add every queued step to its slots and queues."""
        pending, self._pending = self._pending, []
        for mode, shape in pending:
            rows, shape.rows = shape.rows, []
            n = len(rows)
            for slot, spans in shape.slots:
                col = _column(rows, spans)
                totals = slot.totals
                totals[0] += sum(col)
                totals[1] += n
                slot.queue.extend(list(map(truediv, col, _NS)))
            steps = list(map(sub, map(_LAST, rows), map(_FIRST, rows)))
            untracked = [u for u in map(sub, steps, _column(rows, shape.top)) if u > 0]
            if untracked:
                slot = self._slot_for(mode, *_UNTRACKED)
                slot.totals[0] += sum(untracked)
                slot.totals[1] += len(untracked)
                slot.queue.extend(list(map(truediv, untracked, _NS)))
            self._step_queue(mode).extend(list(map(truediv, steps, _NS)))


_UNTRACKED = (sc.PHASE_UNTRACKED, sc.SPAN_STEP)
