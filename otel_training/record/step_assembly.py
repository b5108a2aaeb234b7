"""Pieces in, steps out: the step definition (docs/steps.md), applied.

The tracker cuts the training thread's timeline into *pieces* where a step may
end: a DataLoader batch, a forward after an optimizer update, an
``optimizer.step(closure)``, a framework's batch fetch, the user's ``step()``.
The ``StepAssembler`` decides which pieces make one step and hands each finished
step on, numbered, in time order:

- a training step is one optimizer update: pieces before it (gradient
  accumulation, a rollout) merge into it, and every optimizer stepped in one
  iteration (a GAN's D and G) counts once;
- with no optimizer at all (manual updates), one backward pass is a step;
- a piece with a forward and no backward is an eval step;
- a piece that only waited for data (a loader fetching ahead) merges into the
  next piece (the tracker drops the wait of a loader that ended: StopIteration
  hands out no batch, so that time lies between steps, where coverage counts it).

Everything runs on the training thread, O(1) per piece in the usual loop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from otel_training.config import (
    BOUNDARY_AUTO,
    BOUNDARY_BACKWARD,
    BOUNDARY_DATALOADER,
    BOUNDARY_FORWARD,
    BOUNDARY_OPTIMIZER,
)
from otel_training.record.timeline import BetweenSteps, StepTimeline

# Pieces merged into one step before it is handed on regardless: a loop whose
# optimizer never steps must not hold the whole run in memory (the self-check
# then names the cause).
MAX_PIECES = 4096


class StepAssembler:
    """Groups the tracker's pieces into steps and hands them to ``sink``."""

    def __init__(
        self,
        sink: Callable[[StepTimeline], None],
        boundary: str = BOUNDARY_AUTO,
        release: Callable[[list], None] | None = None,
        between_sink: Callable[[BetweenSteps], None] | None = None,
        probe: Callable[[StepTimeline], bool] | None = None,
    ) -> None:
        # Finished steps go to ``sink``, through ``probe`` first (the FLOP probe) until
        # it answers True: done, it leaves the path.
        self._sink: Callable[[StepTimeline], Any] = sink if probe is None else probe
        self._direct = sink
        self._release = release  # gives a dropped piece's device tokens back
        self.boundary = boundary
        # Optimizers constructed since instrumentation (torch's Optimizer.__init__):
        # with any alive, backward passes without an update are gradient accumulation.
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.alive: set = self.optimizers.data  # type: ignore[attr-defined]  # its set of weak references: len() in C
        self.update_seen = False
        self._next = 0  # steps handed on (train and eval)
        self._train = 0  # train steps handed on: the next train step's number
        self._eval = 0  # eval steps handed on: the next eval step's number
        self._prefix: StepTimeline | None = None  # waits for data, for the next piece
        self._prefix_batches = 0  # batches those waits handed out
        self._pending: StepTimeline | None = None  # backward passes awaiting their update
        self._pending_pieces = 0
        self._held: StepTimeline | None = None  # an update another optimizer may join
        # Named time between steps (record/timeline.py BetweenSteps) goes to this sink
        # (None: dropped), after every step that began before it.
        self.between_sink = between_sink
        self._waiting: list[BetweenSteps] = []  # named time behind a held step

    def optimizer_created(self, optimizer: Any) -> None:
        """An optimizer was constructed (held weakly: alive ones decide what a step is)."""
        self.optimizers.add(optimizer)

    # -- what the tracker asks -----------------------------------------------------------
    def idle(self) -> bool:
        """Nothing held: a piece with its update is handed on as it is."""
        return self._held is None and self._pending is None and self._prefix is None

    @property
    def per_backward(self) -> bool:
        """True when each backward pass is a step of its own (no optimizer)."""
        b = self.boundary
        if b == BOUNDARY_BACKWARD:
            return True
        if b == BOUNDARY_OPTIMIZER:
            return False
        return not self.update_seen and not self.alive

    # -- pieces in -----------------------------------------------------------------------
    def add(self, piece: StepTimeline) -> None:
        """One finished piece of the timeline."""
        if piece.saw_optimizer and self._held is None and self._pending is None and self._prefix is None:
            # The usual loop: a piece with its update, nothing held (no merging).
            # (Optimizer ids are kept only where several optimizers exist.)
            ids = piece.optimizers
            if ids is None or len(ids) >= len(self.alive) or piece.manual or self.boundary != BOUNDARY_AUTO:
                self.update_seen = True
                self._emit(piece)
                return
        if piece.manual:  # the user's step(): a step as it is
            self._resolve()
            self._emit(self._with_prefix(piece))
            return
        if not (piece.saw_forward or piece.saw_backward or piece.saw_optimizer):
            if piece.error is None:
                self._prefix = piece if self._prefix is None else self._prefix.absorb(piece)
                if piece.batch_size is not None:
                    self._prefix_batches += 1
                return
            # A wait that raised (the dataset failed): the step the run failed in.
            self._resolve()
            self._emit(self._with_prefix(piece))
            return
        piece = self._with_prefix(piece)
        b = self.boundary
        if b == BOUNDARY_FORWARD or (b == BOUNDARY_DATALOADER and piece.source is not None):
            self._resolve()
            self._emit(piece)
        elif piece.saw_optimizer:
            self._update(piece)
        elif piece.saw_backward:
            self._emit_held()
            if self.per_backward:
                pending, self._pending = self._pending, None
                self._emit(piece if pending is None else pending.absorb(piece))
            else:
                self._hold_pending(piece)
        elif b == BOUNDARY_OPTIMIZER and piece.train_forward:
            self._emit_held()
            self._hold_pending(piece)
        else:  # a forward batch without backward: an eval step
            self._resolve()
            self._emit(piece)

    def add_between(self, group: BetweenSteps) -> None:
        """Named time between steps, ended: handed on at once, or after the steps held
        now (they began before it), so the pipeline gets everything in time order."""
        if self.idle() and not self._waiting:
            self._hand_between(group)
        else:
            self._waiting.append(group)

    def close(self) -> None:
        """The run ends: hand on what is held; a trailing wait is no step."""
        self._resolve()
        prefix, self._prefix = self._prefix, None
        self._prefix_batches = 0
        if prefix is not None:
            self._drop(prefix)
        self._flush_waiting(None)

    def _flush_waiting(self, before: int | None) -> None:
        """Hand on the named time waiting that began before ``before`` (ns; None: all)."""
        waiting = self._waiting
        while waiting and (before is None or waiting[0].times[0] <= before):
            self._hand_between(waiting.pop(0))

    def _hand_between(self, group: BetweenSteps) -> None:
        sink = self.between_sink
        if sink is not None:
            sink(group)

    # -- grouping ------------------------------------------------------------------------
    def _with_prefix(self, piece: StepTimeline) -> StepTimeline:
        """``piece`` with the waits before it merged in (the step that uses the batch).
        Its samples and tokens: every batch fetched when the step used as many (its
        micro-batches fetched first, torchtitan's ``train_step``); else the last one
        fetched, the others being fetched ahead for later steps (timm, accelerate)."""
        prefix = self._prefix
        if prefix is None:
            return piece
        self._prefix = None
        fetched = self._prefix_batches + (piece.batch_size is not None)
        self._prefix_batches = 0
        batch_size, source, epoch = piece.batch_size, piece.source, piece.epoch
        tokens, masks = piece.token_count, piece.token_masks
        merged = prefix.absorb(piece)  # (sums the samples and tokens)
        merged.continue_as(source, epoch)
        if piece.backwards + piece.closure_backward < fetched:
            merged.take_batch(batch_size, tokens, masks)
        return merged

    def _hold_pending(self, piece: StepTimeline) -> None:
        if self._pending is None:
            self._pending, self._pending_pieces = piece, 1
        else:
            self._pending = self._pending.absorb(piece)
            self._pending_pieces += 1
        if self._pending_pieces >= MAX_PIECES:
            self._resolve()

    def _update(self, piece: StepTimeline) -> None:
        self.update_seen = True
        held = self._held
        if held is not None:
            self._held = None
            if self._pending is None and _disjoint(held.optimizers, piece.optimizers):
                piece = held.absorb(piece)  # another optimizer of the same iteration
            else:
                self._emit(held)
        pending = self._pending
        if pending is not None:
            self._pending = None
            piece = pending.absorb(piece)
        ids = piece.optimizers
        if ids is not None and len(ids) < len(self.alive):
            self._held = piece  # the next piece tells whether another optimizer joins
        else:
            self._emit(piece)

    def _emit_held(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._emit(held)

    def _resolve(self) -> None:
        """Hand on whatever is held: an update, and backward passes without one."""
        self._emit_held()
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._emit(pending)

    # -- steps out -----------------------------------------------------------------------
    def _emit(self, step: StepTimeline) -> None:
        # Steps leave in time order, numbered, never overlapping (coverage relies on it).
        # A train step's number is the train steps before it (the global step at its
        # start, as frameworks count it); an eval step's, the eval steps before it.
        train = self._train
        if step.saw_backward or step.saw_optimizer:
            step.number(train, train)
            self._train = train + 1
        else:
            step.number(self._eval, train)
            self._eval += 1
        self._next += 1
        if self._waiting:  # named time that began before this step goes first
            self._flush_waiting(step.marks[0])
        if self._sink(step):  # the probe is done
            self._sink = self._direct
        if self._waiting and self.idle():
            self._flush_waiting(None)

    @property
    def steps(self) -> int:
        """Steps handed on so far."""
        return self._next

    def _drop(self, piece: StepTimeline) -> None:
        if self._release is not None and piece.tokens:
            self._release(piece.tokens)


def _disjoint(a: list | None, b: list | None) -> bool:
    return a is not None and b is not None and not set(a).intersection(b)
