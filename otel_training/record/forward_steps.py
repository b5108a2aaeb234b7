"""Pieces cut at forwards: what a root module's forward means for the open piece.

``ForwardSteps`` is the part of the ``Tracker`` that reads root forwards: the first
forward of an iteration, a loss module continuing the forward before it, an eval
batch, a segment recomputed inside backward. It owns the roots seen in the open
piece and asks its host -- the tracker -- to begin a piece where a forward cuts
one (a loop without a DataLoader, the forward after an update). Training thread only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

from otel_training import semconv as sc
from otel_training.config import BOUNDARY_FORWARD
from otel_training.record.batches import read_inputs
from otel_training.record.events import DRIVER_DATALOADER, DRIVER_MANUAL, DRIVER_NONE
from otel_training.record.phase_stack import PhaseStack, grad_enabled
from otel_training.record.step_assembly import StepAssembler
from otel_training.record.timeline import StepTimeline

_FORWARD = sc.PHASE_FORWARD
_BACKWARD = sc.PHASE_BACKWARD


class ForwardHost(Protocol):
    """What the forward part needs of the tracker it belongs to."""

    phases: PhaseStack
    driver: str

    def start_step(self, driver: str = ..., source: Any = None, epoch: int | None = None) -> None: ...
    def optimizer_running(self) -> bool: ...


class ForwardSteps:
    """Root forwards, read as step boundaries and forward phases."""

    def __init__(self, host: ForwardHost, assembler: StepAssembler) -> None:
        self._host = host
        self._phases = host.phases
        self._assembler = assembler
        self._forward_boundary = assembler.boundary == BOUNDARY_FORWARD
        torch = sys.modules.get("torch")  # the manual API needs no torch
        self.grad_enabled: Callable[[], bool] = getattr(torch, "is_grad_enabled", None) or grad_enabled
        self._step_root: Any = None  # the first root module called in the step
        self._forward_root: Any = None  # the root that opened the last forward phase
        self._last_root: Any = None  # the last root called (a continuation's too)
        self.unstepped = 0  # forwards with no step open under a manual driver
        # the piece a framework's callback began outside the framework's steps (identity
        # only: the framework's next boundary ends it; a closed piece is never open again)
        self.outside: StepTimeline | None = None

    def reset(self) -> None:
        """A new piece begins: no root has run in it."""
        self._step_root = None
        self._forward_root = None
        self._last_root = None

    def begin(self, root: Any, loss: bool) -> None:
        """A root module's forward began (``root``: that module; ``loss``: it has no
        parameters, a loss module)."""
        host, phases = self._host, self._phases
        step = phases.step
        driver = host.driver
        if step is None:
            # No piece open: a loop without a DataLoader (or code after a DataLoader
            # loop ended) -- pieces are cut at forwards. Inside a manual step() loop,
            # time outside step() belongs to no step.
            if driver == DRIVER_MANUAL:
                self.unstepped += 1  # model work the user's steps leave out
                return
            fresh = True
        elif step.saw_forward or step.saw_backward or step.saw_optimizer:
            stack = phases.stack
            top = stack[-1] if stack else None
            if top is not None and top is phases.batch and root is not self._forward_root:
                last = step.phases[-1]
                if loss and last.name == _FORWARD and last.outer is top and last.end == len(step.marks) - 1:
                    # A loss module right after the last forward (nothing timed in
                    # between): the same forward goes on -- one phase, no new mark.
                    # (A model -- the same RNN cell again, a critic after the actor, a
                    # value network after the env step -- is a forward of its own.)
                    phases.resume(last)
                    self._last_root = root
                    if not step.train_forward and self.grad_enabled() and getattr(root, "training", True):
                        step.trained_forward()
                    return
            if top is not None and top.name == _BACKWARD:
                return  # a checkpointed segment recomputed by the backward pass: part of it
            fresh = (
                (driver == DRIVER_NONE or driver == DRIVER_DATALOADER)
                and not host.optimizer_running()
                and self._cuts(step, root)
            )
        else:
            fresh = False
        if fresh:  # a piece cut here begins with this forward
            if driver == DRIVER_NONE or driver == DRIVER_DATALOADER:
                host.start_step(DRIVER_NONE)
            else:
                self.open_outside()
            step = phases.step
            phases.open_container(0)
            phases.open(_FORWARD, True, 0)
        elif phases.to_device_from >= 0 and not phases.stack:
            at = phases.close_to_device()
            phases.open_container(at)
            phases.open(_FORWARD, True, at)
        elif not phases.begin_phase(_FORWARD, auto=True):
            return
        self._forward_root = self._last_root = root
        if self._step_root is None:
            self._step_root = root
        step.forward_ran()
        if not step.train_forward and self.grad_enabled() and getattr(root, "training", True):
            step.trained_forward()

    def open_outside(self) -> None:
        """A framework drives steps and none is open, yet its callback runs the model or
        reads a loader (an image sampler after the epoch: one no_grad batch of its own
        loader): a piece of its own, the framework's, ended by its next boundary."""
        host = self._host
        host.start_step(host.driver)
        self.outside = self._phases.step

    def inputs(self, root: Any, args: tuple, kwargs: dict | None) -> None:
        """Samples and tokens of each forward of the step's first root when no DataLoader
        drives (nanoGPT's ``model(x, y)``), outside optimizer steps (LBFGS closures)."""
        step = self._phases.step
        stack = self._phases.stack
        if (
            step is not None
            and root is self._step_root
            and not self._host.optimizer_running()
            and not (stack and stack[-1].name == _BACKWARD)
        ):
            read_inputs(args, kwargs, step)

    def _cuts(self, step: StepTimeline, root: Any) -> bool:
        """Whether a root forward (not continuing the last) begins a new piece;
        ``step`` already holds work."""
        if self._forward_boundary:
            return True
        if step.saw_optimizer:
            # After an update: the next iteration, an eval forward, or another
            # optimizer's part of the iteration (a GAN's G: the assembler merges it).
            return True
        if step.saw_backward:  # accumulation, unless each backward is a step
            return self._assembler.per_backward
        if self._host.driver != DRIVER_NONE or step.train_forward:
            return False  # a rollout, a target network under no_grad, the loss module
        # Eval forwards: a root that already ran in the piece begins the next batch.
        return (
            root is self._step_root
            or root is self._last_root
            or (self.grad_enabled() and getattr(root, "training", True))
        )
