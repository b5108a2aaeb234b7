"""Untraced steps grouped by shape, their phase times added column by column.

Most steps of a loop have the same *shape*: the same phases, nested the same way,
starting and ending at the same mark indices. ``add`` queues such a step's marks
under its shape (a few C-level calls); ``flush`` computes, for all the queued
steps of a shape at once, every phase's times, sums and queues them for binning
in C-level loops (``map``, ``sum``) rather than a Python loop per phase per step,
which was most of the pipeline's cost at short steps. What comes out is what
processing each step alone gives: the same summary totals and histogram values.

Both run on the pipeline thread, for untraced steps timed by host clocks; traced
and GPU-timed steps, and shapes past ``_MAX_SHAPES``, go the per-step way.
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
UNTRACKED_KEY = (sc.PHASE_UNTRACKED, sc.SPAN_STEP)  # the (name, parent) of untracked time


class _Shape:
    """One step shape: per phase (name, parent), the (start, end) mark indices to
    sum; the top-level ones (their sum is the tracked time); its queued steps."""

    __slots__ = ("mode", "spans", "top", "slots", "rows", "samples", "microbatches")

    def __init__(self, mode: str, spans: Dict[Tuple[str, str], List[Tuple[int, int]]],
                 top: List[Tuple[int, int]]) -> None:
        self.mode = mode
        self.spans = spans
        self.top = top
        self.slots: Optional[list] = None  # (slot, spans), resolved at the first flush
        self.rows: List[list] = []  # marks of the queued steps
        self.samples = 0  # their batch sizes' sum
        self.microbatches = 0  # their micro-batches' sum


def _column(rows: List[list], spans: List[Tuple[int, int]]) -> List[int]:
    """Per row, the summed durations of ``spans`` (pairs of mark indices)."""
    col: Optional[List[int]] = None
    for start, end in spans:
        c = list(map(sub, map(itemgetter(end), rows), map(itemgetter(start), rows)))
        col = c if col is None else list(map(int.__add__, col, c))
    return col if col is not None else [0] * len(rows)


class Shapes:
    """Steps queued by shape; ``flush`` adds them to their phase slots.

    ``slot_for(mode, name, parent)``: the pipeline's ``_PhaseSlot`` (``totals``,
    ``queue``); ``step_queue(mode)``: where step durations go; ``on_steps(mode,
    first_start, last_end, step_ns, samples, microbatches)``: the steps' totals (summary,
    counters).
    """

    def __init__(self, slot_for: Callable[[str, str, str], Any], step_queue: Callable[[str], list],
                 on_steps: Callable[[str, int, int, List[int], int, int], None]) -> None:
        self._slot_for = slot_for
        self._step_queue = step_queue
        self._on_steps = on_steps
        self._shapes: Dict[str, Dict[tuple, Optional[_Shape]]] = {}
        self._queued: List[_Shape] = []  # shapes with rows, in first-use order

    def add(self, mode: str, phases: list, marks: list, batch_size: Optional[int],
            microbatches: Optional[int] = None) -> bool:
        """Queue one untraced step; False if its shape is not handled here."""
        shapes = self._shapes.get(mode)
        if shapes is None:
            shapes = self._shapes[mode] = {}
        key = tuple(map(_SHAPE, phases))
        shape = shapes.get(key, False)
        if shape is False:
            if len(shapes) >= _MAX_SHAPES:
                return False  # not remembered: the table stays bounded
            shape = shapes[key] = _new_shape(mode, phases)
        if shape is None:
            return False
        rows = shape.rows
        if not rows:
            self._queued.append(shape)
        rows.append(marks)
        shape.samples += batch_size or 0
        if microbatches:
            shape.microbatches += microbatches
        return True

    def flush(self) -> None:
        """Add every queued step to its slots and queues."""
        queued = self._queued
        while queued:  # one shape at a time: after a failure, ``drop`` finds the rest
            shape = queued.pop(0)
            rows, shape.rows = shape.rows, []
            samples, shape.samples = shape.samples, 0
            microbatches, shape.microbatches = shape.microbatches, 0
            self._add(shape, rows, samples, microbatches)

    def drop(self) -> int:
        """Forget every queued step (after a failed ``flush``); how many there were."""
        queued, self._queued = self._queued, []
        n = 0
        for shape in queued:
            n += len(shape.rows)
            shape.rows, shape.samples, shape.microbatches = [], 0, 0
        return n

    def _add(self, shape: _Shape, rows: List[list], samples: int, microbatches: int) -> None:
        mode = shape.mode
        if shape.slots is None:
            shape.slots = [(self._slot_for(mode, name, parent), s) for (name, parent), s in shape.spans.items()]
        for slot, spans in shape.slots:
            _add_column(slot, _column(rows, spans))
        steps = list(map(sub, map(_LAST, rows), map(_FIRST, rows)))
        untracked = [u for u in map(sub, steps, _column(rows, shape.top)) if u > 0]
        if untracked:
            _add_column(self._slot_for(mode, *UNTRACKED_KEY), untracked)
        self._step_queue(mode).extend(list(map(truediv, steps, _NS)))
        self._on_steps(mode, rows[0][0], rows[-1][-1], steps, samples, microbatches)


def _add_column(slot: Any, ns: List[int]) -> None:
    """One phase's times, a step each: into its run totals and its histogram queue."""
    totals = slot.totals
    totals[0] += sum(ns)
    totals[1] += len(ns)
    slot.queue.extend(list(map(truediv, ns, _NS)))


def _new_shape(mode: str, phases: list) -> Optional[_Shape]:
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
    return _Shape(mode, spans, top)
