"""DDP's gradient synchronization: its exposed wait, as the ``communication`` phase.

DDP all-reduces gradient buckets while ``backward`` still computes; what is left of
the all-reduce when the last gradient is ready is waited for at the end of the
backward pass (the reducer's finalize callback), inside ``torch.autograd.backward``.
That wait is what the network (or a slower rank, which the all-reduce waits for)
costs the step. ``GradSync`` measures it without touching what DDP or the user
registered: a post-accumulate-grad hook on each parameter of every
``DistributedDataParallel`` module notes when its gradient is ready; the time from
the last one to the end of ``backward`` becomes a ``communication`` child of
``backward`` (record/torch_hooks.py asks for it when the backward pass ends).

A comm hook the user registered (``register_comm_hook``) runs as before: its
all-reduce, compression or waits fall in the same window.

FSDP2 (``fully_shard``): its parameter groups' all-gathers (``unshard``,
``wait_for_unshard``) and reduce-scatters (``post_backward``, ``finalize_backward``)
are timed where the training thread calls them, each a ``communication`` child of the
phase it blocks (``forward`` or ``backward``). On the CPU (gloo) these calls block for
the collective; on CUDA they mostly enqueue work on FSDP's streams, and the host time
is what they block the training thread for.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from otel_training import semconv as sc
from otel_training.handles import Handles
from otel_training.record.events import TrainingEvents

# FSDP2's parameter-group methods that run (and on the CPU wait for) its collectives.
_FSDP_COLLECTIVES = ("unshard", "wait_for_unshard", "post_backward", "finalize_backward")
_get_ident = threading.get_ident


class GradSync:
    """Post-accumulate-grad hooks on DDP modules' parameters; one handle."""

    def __init__(self, events: TrainingEvents, on_error: Callable[[str, BaseException], None]) -> None:
        self._events = events
        self._on_error = on_error
        self._handles = Handles()
        self._hooks: list[Any] = []  # torch RemovableHandles on DDP parameters
        # [host ns the last DDP gradient of this backward pass was ready; 0: none]
        # (a list: the hooks write it from whichever thread autograd runs them on)
        self.ready = [0]

    def install(self) -> GradSync:
        try:
            from torch.nn.parallel import DistributedDataParallel
        except Exception:  # pragma: no cover - torch without distributed
            return self
        self._handles.wrap(DistributedDataParallel, "__init__", self._ddp_init)
        FSDPParamGroup = _fsdp_param_group()
        if FSDPParamGroup is None:  # torch without FSDP2
            return self
        for name in _FSDP_COLLECTIVES:
            if hasattr(FSDPParamGroup, name):
                self._handles.wrap(FSDPParamGroup, name, self._fsdp_collective)
        return self

    def _fsdp_collective(self, wrapped, instance, args, kwargs):
        """An FSDP2 all-gather or reduce-scatter: its time on the training thread."""
        events = self._events
        since = 0
        try:
            if events.step is not None and events.thread == _get_ident():
                since = events.now()
        except Exception as exc:
            self._on_error("communication", exc)
        result = wrapped(*args, **kwargs)
        if since:
            try:
                events.waited(sc.PHASE_COMMUNICATION, since)
            except Exception as exc:
                self._on_error("communication", exc)
        return result

    def remove(self) -> None:
        self._handles.remove()
        hooks, self._hooks = self._hooks, []
        for h in reversed(hooks):
            try:
                h.remove()
            except Exception:  # pragma: no cover - a parameter already gone
                pass
        self.ready[0] = 0

    def _ddp_init(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        try:
            self._watch(instance)
        except Exception as exc:
            self._on_error("communication", exc)
        return result

    def _watch(self, ddp: Any) -> None:
        now, ready, on_error = self._events.now, self.ready, self._on_error

        def grad_ready(_param: Any) -> None:
            try:
                ready[0] = now()
            except Exception as exc:  # (autograd would raise it in the user's backward)
                on_error("communication", exc)

        for p in ddp.module.parameters():
            if not p.requires_grad:
                continue
            register = getattr(p, "register_post_accumulate_grad_hook", None)
            if register is not None:
                self._hooks.append(register(grad_ready))
            else:  # pragma: no cover - torch < 2.1: when the gradient is computed
                self._hooks.append(p.register_hook(lambda g: grad_ready(None)))

    def backward_ended(self) -> None:
        """The backward pass is ending: its wait after the last DDP gradient, if any."""
        ready = self.ready
        since, ready[0] = ready[0], 0
        if since:
            try:
                self._events.waited(sc.PHASE_COMMUNICATION, since)
            except Exception as exc:
                self._on_error("communication", exc)


def _fsdp_param_group() -> Any:
    """FSDP2's parameter-group class: public ``fully_shard`` since torch 2.6, the
    ``_composable`` prototype before (CUDA only there)."""
    for name in (
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",
        "torch.distributed._composable.fsdp._fsdp_param_group",
    ):
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        cls = getattr(module, "FSDPParamGroup", None)
        if cls is not None:
            return cls
    return None
