"""Pieces cut at data loading: a DataLoader's (or Grain's) batches begin pieces.

``LoaderSteps`` is the part of the ``Tracker`` that decides what a loader's events
mean for the open piece: a new loop, a new batch (a new piece) or another wait of
the same step, a loader's end. It writes only the loader state it owns (the loader
kinds seen, the source iterator, the last fetched piece) and asks its host -- the
tracker -- to close and open pieces. Training thread only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

from otel_training import semconv as sc
from otel_training.record.batches import read_batch
from otel_training.record.events import DRIVER_DATALOADER, DRIVER_MANUAL, DRIVER_NONE
from otel_training.record.phase_stack import PhaseStack
from otel_training.record.timeline import StepTimeline, has_work

_ITER_GAP_NS = 5_000_000  # iter(loader) this close before its first next(): one wait


def _gone() -> None:
    """A weak reference's answer once its object is gone."""
    return None


class PieceHost(Protocol):
    """What the loader part needs of the tracker it belongs to."""

    phases: PhaseStack
    driver: str
    on_loop: Callable[[], None] | None

    def close_piece(self, token: Any, now: int) -> None: ...
    def new_piece(self, source: Any = None, epoch: int | None = None) -> StepTimeline: ...
    def piece_opened_by_loader(self) -> None: ...


class LoaderSteps:
    """Loader events, read as step boundaries."""

    def __init__(self, host: PieceHost) -> None:
        self._host = host
        self._phases = host.phases
        # kinds of loader whose loops this thread began ("torch", "grain"); replaced, never
        # mutated, so the summary reads it from another thread
        self.kinds: frozenset[str] = frozenset()
        self._fetched: StepTimeline | None = None  # the piece of the last batch a loader handed out
        self._source_id = 0  # id() of the iterator that began the last piece, and
        self._source: Callable[[], Any] = _gone  # a weak reference to it
        self.forwards: Any = None  # the tracker's ForwardSteps: it opens pieces outside a framework's steps

    def iter_begin(self, kind: str) -> tuple:
        """A loader's iterator is made: a new loop ends the open step (unless a manual
        ``step()`` or a framework drives). Returns the instant, ``(token, ns)``, from
        which the loop's first step counts (so worker start-up lands in its first wait)."""
        host, phases = self._host, self._phases
        if kind not in self.kinds:
            self.kinds = self.kinds | {kind}
        token, now = phases.stamp()
        step = phases.step
        if step is not None and host.driver in (DRIVER_NONE, DRIVER_DATALOADER):
            if (
                step.source is not None
                and step.source == self._source_id
                and not (step.saw_forward or step.saw_backward or step.saw_optimizer)
                and self._source() is None
            ):
                # A loop left with ``break`` after one more fetch (Fabric's
                # ``limit_batches`` check): that batch feeds no step, and the time until
                # this loop (an epoch-end log's ``.item()``) lies between steps, as after
                # a loader's end.
                phases.discard()
            if phases.step is not None:
                host.close_piece(token, now)
        if host.on_loop is not None:
            host.on_loop()
        return token, now

    def next_begin(self, iterator: Any, started_at: tuple | None) -> bool:
        """A loader iterator's ``__next__`` was entered; True if recording."""
        host, phases = self._host, self._phases
        step = phases.step
        if host.driver not in (DRIVER_NONE, DRIVER_DATALOADER):
            forwards = self.forwards
            if (
                host.driver != DRIVER_MANUAL
                and forwards is not None
                and (step is None or (step is forwards.outside and has_work(step)))
            ):
                # A framework's callback reading a loader of its own outside the
                # framework's steps: the batch's wait begins the eval step that uses
                # it (the next batch of such a loop, the next one).
                forwards.open_outside()
            return phases.begin_phase(sc.PHASE_DATALOADER_NEXT, auto=True)
        # A new batch: the same loader again, or another loader once the piece holds
        # work other than a training forward still waiting for its backward. Otherwise
        # another wait of the same step: zip(loader_a, loader_b), or a second loader
        # read mid-iteration (a target-domain batch after the source forward).
        new = (
            step is None
            or step.source == id(iterator)
            or (
                has_work(step)
                and (step.source is None or step.saw_backward or step.saw_optimizer or not step.train_forward)
            )
        )
        if not new:
            return phases.begin_phase(sc.PHASE_DATALOADER_NEXT, auto=True)
        host.driver = DRIVER_DATALOADER
        token, now = phases.stamp()
        if step is not None:
            host.close_piece(token, now)  # the next step begins where this one ends
        elif started_at is not None and now - started_at[2] < _ITER_GAP_NS:
            # ``for batch in loader``: the iterator's start-up (workers) counts in the
            # first wait -- not when the iterator was made long before its first batch.
            token, now = started_at[0], started_at[1]
        # Only the iterator's id is kept: holding the iterator would keep its worker
        # processes alive after the user's loop let go of it (and fork copies of it).
        # A weak reference tells whether the loop let go of it (iter_begin).
        if self._source() is not iterator:
            self._source_id = id(iterator)
            self._source = weakref.ref(iterator)
        step = host.new_piece(id(iterator), getattr(iterator, "_otel_epoch", None))
        phases.push(step, token, now)
        phases.open(sc.PHASE_DATALOADER_NEXT, True, 0)
        host.piece_opened_by_loader()
        return True

    def next_end(self, batch: Any) -> None:
        """The batch arrived: its size and tokens; a copy to the device may follow."""
        phases = self._phases
        step = phases.step
        if step is None:
            return
        phases.end_phase(sc.PHASE_DATALOADER_NEXT)
        if step.batch_size is None:
            read_batch(batch, step)
        self._fetched = step
        if not phases.stack:
            phases.to_device_may_begin()

    def fetched(self, step: StepTimeline) -> None:
        """``step`` holds the last batch a loader handed out (a repeated piece)."""
        self._fetched = step

    def stopped(self, wrapped: bool) -> None:
        """``__next__`` raised StopIteration: a piece with only that wait is no
        step, nor part of one (no batch came of it: the time lies between steps).
        ``wrapped``: in a watched wrapper's loop (record/loop_wrappers.py), which may
        still hand out a batch fetched ahead: the piece stays for it until ``loop_ended``."""
        host, phases = self._host, self._phases
        if host.on_loop is not None:  # what runs after a loop may call a model not seen yet
            host.on_loop()
        step = phases.step
        if step is None:
            return
        if not wrapped and step.source is not None and not has_work(step) and host.driver == DRIVER_DATALOADER:
            phases.discard()
            return
        phases.end_phase(sc.PHASE_DATALOADER_NEXT)
        last = self._fetched
        if wrapped and step.batch_size is None and last is not None and last is not step:
            # The batch the loop hands out last was fetched by the piece before: its size.
            step.take_batch(last.batch_size, last.token_count, last.token_masks)

    def loop_ended(self) -> None:
        """A watched wrapper's loop ended (its generator returned): the open piece ends
        here, as at a loader's end; a piece with only waits is no step."""
        host, phases = self._host, self._phases
        step = phases.step
        if step is not None and host.driver == DRIVER_DATALOADER:
            if has_work(step):
                host.close_piece(*phases.stamp())
            else:
                phases.discard()
        if host.on_loop is not None:  # what runs after a loop may call a model not seen yet
            host.on_loop()
