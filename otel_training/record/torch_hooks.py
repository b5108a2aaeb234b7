"""Hooks into torch other than modules: DataLoader, backward, optimizers, LR
schedulers, device-to-host reads and user collectives.

``TorchHooks`` is one handle: ``install()`` attaches every hook (each a handle of
its own, kept in order) and ``remove()`` takes them off in reverse. Every wrapper
follows one rule: our code runs inside ``try/except`` and reports to ``on_error``;
the user's call runs outside it, so the user's exceptions propagate unchanged (and
mark the step as failed).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from otel_training import semconv as sc
from otel_training.handles import Handles
from otel_training.record.events import TrainingEvents
from otel_training.record.foreign_loaders import ForeignLoaders
from otel_training.record.grad_sync import GradSync
from otel_training.record.loop_wrappers import LoopWrappers

_FROM_DEVICE_METHODS = ("item", "cpu", "tolist", "numpy")
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
    "scatter",
    "all_to_all",
    "barrier",
)
# torch.compiler.is_compiling itself (dynamo folds it to True while tracing).
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
_get_ident = threading.get_ident


class TorchHooks:
    """DataLoader, backward, optimizer, LR scheduler, device read and collective hooks."""

    def __init__(self, events: TrainingEvents, on_error: Callable[[str, BaseException], None]) -> None:
        self._events = events
        self._on_error = on_error
        self._handles = Handles()
        self._loops = LoopWrappers(events, on_error)  # generators wrapping a loader's loop
        # Loops begun per loader (its epoch numbers), kept here rather than on the user's loader.
        self._epochs: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def install(self) -> TorchHooks:
        """Attach every hook; ``remove()`` undoes them all."""
        self._install_data_loading()
        self._grad_sync = self._handles.add(GradSync(self._events, self._on_error).install())
        self._install_backward()
        self._install_optimizers()
        self._install_lr_schedulers()
        self._install_device_reads()
        self._install_collectives()
        return self

    def remove(self) -> None:
        self._handles.remove()

    # -- DataLoader ---------------------------------------------------------------------
    def _install_data_loading(self) -> None:
        from torch.utils.data import dataloader as dl

        handles, events, on_error = self._handles, self._events, self._on_error
        handles.add(self._loops.install())
        handles.add(ForeignLoaders(events, on_error).install())  # Grain: its iterators timed like DataLoaders'
        handles.wrap(dl.DataLoader, "__iter__", self._loader_iter)
        handles.wrap_plain(dl._BaseDataLoaderIter, "__next__", self._loader_next_wrapper())  # every step: no wrapt

    def _loader_iter(self, wrapped, instance, args, kwargs):
        """``DataLoader.__iter__``: a loop begins (its workers' start-up counts in its first wait)."""
        events, on_error = self._events, self._on_error
        started = None
        try:
            if events.on_training_thread():
                started = events.loader_iter_begin()
        except Exception as exc:
            on_error("dataloader", exc)
        it = wrapped(*args, **kwargs)
        if started is not None:
            try:
                started = started + (events.now(),)  # (token, start ns, end ns) of the start-up
            except Exception as exc:
                started = None
                on_error("dataloader", exc)
            try:
                self._loops.discover(sys._getframe(1))  # a generator wrapping the loader's loop?
            except Exception as exc:
                on_error("dataloader", exc)
        try:
            epochs = self._epochs
            epoch = epochs.get(instance, 0)
            if not epoch:  # this loader's first loop: its settings, once
                try:
                    events.loader_opened(instance)
                except Exception as exc:
                    on_error("dataloader", exc)
            epochs[instance] = epoch + 1
            it._otel_epoch = epoch
            if started is not None:
                it._otel_started = started
        except Exception:
            pass  # an iterator without __dict__: no epoch, no start-up time
        return it

    def _loader_next_wrapper(self) -> Callable:
        """``_BaseDataLoaderIter.__next__``, every step: a closure over locals (no
        attribute lookups on the hot path)."""
        events, on_error = self._events, self._on_error
        watched_loops = self._loops.frames

        def loader_next(wrapped, instance, args, kwargs):
            recording = False
            try:
                if events.thread == _get_ident() or events.on_training_thread():
                    state = getattr(instance, "__dict__", None)
                    started = state.pop("_otel_started", None) if state else None
                    recording = events.loader_next_begin(instance, started)
            except Exception as exc:
                on_error("dataloader", exc)
            if not recording:
                return wrapped(*args, **kwargs)
            try:
                batch = wrapped(*args, **kwargs)
            except StopIteration:
                try:
                    # In a watched wrapper's loop (record/loop_wrappers.py) a batch may still come.
                    # (Frame 2: the caller of __next__, past wrap_plain's patched function.)
                    events.loader_stopped(bool(watched_loops) and id(sys._getframe(2)) in watched_loops)
                except Exception as exc:
                    on_error("dataloader", exc)
                raise
            except BaseException as exc:
                _mark_error(events, exc)
                try:
                    events.end_phase(sc.PHASE_DATALOADER_NEXT)
                except Exception as exc2:
                    on_error("dataloader", exc2)
                raise
            try:
                events.loader_next_end(batch)
            except Exception as exc:
                on_error("dataloader", exc)
            return batch

        return loader_next

    # -- backward -------------------------------------------------------------------------
    def _install_backward(self) -> None:
        events, sync = self._events, self._grad_sync
        ready = sync.ready

        def backward_begin() -> bool:
            ready[0] = 0  # (a DDP gradient from a backward pass not recorded)
            return events.backward_begin()

        def backward_end(_token: Any) -> None:
            if ready[0]:  # DDP's gradient sync: its wait after the last gradient
                sync.backward_ended()
            events.end_phase(sc.PHASE_BACKWARD)

        self._handles.wrap_plain(
            torch.autograd, "backward", self._phase_wrapper("backward", backward_begin, backward_end)
        )

    # -- optimizer steps: torch's global hooks, not patches ----------------------------------
    def _install_optimizers(self) -> None:
        from torch.optim import optimizer as optim_mod

        handles = self._handles
        handles.add(optim_mod.register_optimizer_step_pre_hook(self._optimizer_pre))
        handles.add(optim_mod.register_optimizer_step_post_hook(self._optimizer_post))
        handles.wrap(optim_mod.Optimizer, "__init__", self._optimizer_init)
        # AMP: GradScaler.step is the optimizer step (its found-inf .item() included). A
        # step whose optimizer did not run (inf/NaN gradients) is still a step, marked skipped.
        scaler_step = self._phase_wrapper("optimizer", self._scaler_begin, self._scaler_end)
        scaler_base = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if isinstance(scaler_base, type):
            for cls in _subclasses(scaler_base) | {scaler_base}:
                if "step" in vars(cls):
                    handles.wrap(cls, "step", scaler_step)

    def _optimizer_pre(self, optimizer, args, kwargs):
        if _is_compiling():  # a compiled optimizer step: stay out of the graph
            return None
        events = self._events
        try:
            if events.thread == _get_ident() or events.on_training_thread(True):
                # args[0] is the optimizer: plain opt.step() has no closure
                closure = (len(args) > 1 or kwargs) and _closure_of(args, kwargs) is not None
                if closure:
                    events.closure_step_begin()
                events.optimizer_pre(optimizer, sys._getframe(1))
                if closure and events.step is not None:
                    return _with_wrapped_closure(events, optimizer, args, kwargs)
        except Exception as exc:
            self._on_error("optimizer", exc)
        return None

    def _optimizer_post(self, optimizer, args, kwargs):
        if _is_compiling():
            return
        events = self._events
        try:
            if events.thread == _get_ident() or events.on_training_thread(True):
                events.optimizer_post(optimizer)
        except Exception as exc:
            self._on_error("optimizer", exc)

    def _optimizer_init(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        try:
            self._events.optimizer_created(instance)
        except Exception as exc:
            self._on_error("optimizer", exc)
        return result

    def _scaler_begin(self) -> Any:
        events = self._events
        step = events.step
        if step is None:
            return None
        rec = events.optimizer_begin()
        return (rec, step, step.updates) if rec is not None else None

    def _scaler_end(self, token: Any) -> None:
        rec, step, updates = token
        events = self._events
        events.end_record(rec)
        current = step is events.step  # (the step the scaler began in is still open)
        if current and step.updates == updates:
            step.update_skipped()

    # -- LR schedulers, device-to-host reads, user collectives -------------------------------
    def _install_lr_schedulers(self) -> None:
        from torch.optim import lr_scheduler as lrs

        lr_step = self._named_phase(sc.PHASE_LR_SCHEDULERS, "lr_scheduler")
        base = getattr(lrs, "LRScheduler", None) or lrs._LRScheduler
        for cls in _subclasses(base) | {base, getattr(lrs, "ReduceLROnPlateau", base)}:
            if "step" in vars(cls):
                self._handles.wrap(cls, "step", lr_step)

    def _install_device_reads(self) -> None:
        read = self._named_phase(sc.PHASE_FROM_DEVICE, "from_device")
        for method in _FROM_DEVICE_METHODS:
            self._handles.wrap(torch.Tensor, method, read)

    def _install_collectives(self) -> None:
        if not torch.distributed.is_available():
            return
        collective = self._named_phase(sc.PHASE_REDUCE_METRICS, "distributed")
        for name in _COLLECTIVES:
            if hasattr(torch.distributed, name):
                self._handles.wrap(torch.distributed, name, collective)

    # -- the wrapper they share ---------------------------------------------------------------
    def _named_phase(self, name: str, component: str) -> Callable:
        events = self._events
        return self._phase_wrapper(component, lambda: events.begin_phase(name, auto=True), name=name)

    def _phase_wrapper(
        self, component: str, begin: Callable[[], Any], end: Callable[[Any], None] | None = None, name: str = ""
    ) -> Callable:
        """A wrapper that opens a phase with ``begin()`` (a falsy result: not
        recording) and closes it with ``end(token)`` -- or, without ``end``, closes
        the phase ``name`` -- the user's call between."""
        events, on_error = self._events, self._on_error

        def wrapper(wrapped, instance, args, kwargs):
            token = None
            try:
                if events.step is not None and (events.thread == _get_ident() or events.on_training_thread()):
                    token = begin()
            except Exception as exc:
                on_error(component, exc)
            if not token:
                return wrapped(*args, **kwargs)
            try:
                return wrapped(*args, **kwargs)
            except BaseException as exc:
                _mark_error(events, exc)
                raise
            finally:
                try:
                    if end is None:
                        events.end_phase(name)
                    else:
                        end(token)
                except Exception as exc:
                    on_error(component, exc)

        return wrapper


def _closure_of(args: tuple, kwargs: dict) -> Any:
    closure = kwargs.get("closure")
    if closure is None and len(args) > 1 and callable(args[1]):
        closure = args[1]
    return closure


def _with_wrapped_closure(events: TrainingEvents, optimizer: Any, args: tuple, kwargs: dict):
    """New (args, kwargs) for torch's pre-hook protocol when a closure was passed."""
    if kwargs.get("closure") is not None:
        kwargs = dict(kwargs)
        kwargs["closure"] = events.wrap_closure(optimizer, kwargs["closure"])
        return args, kwargs
    if len(args) > 1 and callable(args[1]):
        return (args[0], events.wrap_closure(optimizer, args[1])) + tuple(args[2:]), kwargs
    return None


def _subclasses(cls) -> set:
    out, todo = set(), [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


def _mark_error(events: TrainingEvents, exc: BaseException) -> None:
    try:
        events.record_error(exc)
    except Exception:  # pragma: no cover - the user's exception goes on regardless
        pass
