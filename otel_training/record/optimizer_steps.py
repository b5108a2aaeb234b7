"""Optimizer steps in the open piece: torch's pre/post hook pairs and closures.

``OptimizerSteps`` keeps the optimizer steps running now (nested ones included) and
opens and closes their ``optimizer_step`` phases in the ``PhaseStack`` it is given.
The ``Tracker`` owns one and decides when a closure step begins a piece.
Training thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from otel_training import semconv as sc
from otel_training.record.phase_stack import PhaseStack
from otel_training.record.timeline import PhaseRecord


class OptimizerSteps:
    """The optimizer steps under way in the open piece, innermost last."""

    def __init__(self, phases: PhaseStack, alive: set) -> None:
        self._phases = phases
        self._alive = alive  # the optimizers alive (weak references; len() in C)
        self.pending: list[tuple] = []  # (optimizer, record or None, frame) awaiting a post-hook
        self.unstepped = 0  # optimizer steps with no step open

    def reset(self) -> None:
        """A new piece begins (or the open one ended): nothing is running."""
        if self.pending:
            self.pending = []

    def begin(self) -> PhaseRecord | None:
        """An optimizer step began: its record, or None when not recording / nested in
        another auto phase."""
        phases = self._phases
        step = phases.step
        if step is None:
            return None
        step.optimizer_began()
        return phases.stack[-1] if phases.begin_phase(sc.PHASE_OPTIMIZER_STEP, auto=True) else None

    def pre(self, optimizer: Any, frame: Any = None) -> None:
        """torch's global optimizer step pre-hook; pairs with ``post``. ``frame``: the
        frame running that ``Optimizer.step`` (the hook's caller)."""
        phases = self._phases
        step = phases.step
        if step is None:
            self.unstepped += 1
            return
        step.optimizer_stepped(id(optimizer), len(self._alive) > 1)  # several: does another join?
        pending = self.pending
        if pending and frame is not None:
            # A step that raised never runs its post-hooks: its frame is gone from
            # the stack. Close what it left open (a nested step's frame is live).
            live = set()
            f = frame
            while f is not None:
                live.add(id(f))
                f = f.f_back
            while pending and pending[-1][2] is not None and id(pending[-1][2]) not in live:
                phases.end_record(pending.pop()[1])
        pending.append((optimizer, self.begin(), frame))

    def post(self, optimizer: Any) -> None:
        """Close the phase this optimizer's pre-hook opened, if any (an optimizer that
        steps an inner one must not end the outer phase early)."""
        pending = self.pending
        if pending and pending[-1][0] is optimizer:  # the usual case: the innermost
            self._phases.end_record(pending.pop()[1])
            return
        for i in range(len(pending) - 2, -1, -1):
            if pending[i][0] is optimizer:
                rec = pending[i][1]
                del pending[i:]
                self._phases.end_record(rec)
                return

    def wrap_closure(self, optimizer: Any, closure: Callable) -> Callable:
        """``optimizer.step(closure)``: the closure's forward and backward are their
        own phases, so the optimizer phase pauses while it runs."""
        steps, phases = self, self._phases

        def closure_with_phases(*args: Any, **kwargs: Any) -> Any:
            pending = steps.pending
            index = next((i for i in range(len(pending) - 1, -1, -1) if pending[i][0] is optimizer), None)
            if index is None:
                return closure(*args, **kwargs)
            opt, rec, frame = pending[index]
            phases.end_record(rec)
            phases.closure_began()
            try:
                return closure(*args, **kwargs)
            finally:
                phases.closure_ended()
                if index < len(pending) and pending[index][0] is opt:
                    pending[index] = (opt, steps.begin(), frame)

        return closure_with_phases
