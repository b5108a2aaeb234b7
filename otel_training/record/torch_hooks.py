"""Hooks into torch other than modules: DataLoader, backward, optimizers, LR
schedulers, device-to-host reads and user collectives.

Every wrapper follows one rule: our code runs inside ``try/except`` and reports to
``on_error``; the user's call runs outside it, so the user's exceptions propagate
unchanged (and mark the step as failed).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from otel_training import semconv as sc
from otel_training.handles import Handles
from otel_training.record.foreign_loaders import ForeignLoaders
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


def install_torch_hooks(tracker: Any, handles: Handles, on_error: Callable) -> None:
    """Install all non-module hooks; each patch and torch hook goes to ``handles``."""
    patcher = handles
    wrappers = handles.add(LoopWrappers(tracker, on_error).install())
    handles.add(ForeignLoaders(tracker, on_error).install())  # Grain: its iterators timed like DataLoaders'
    watched_loops = wrappers.frames

    def phase_wrapper(
        component: str, begin: Callable[[], Any], end: Callable[[Any], None] | None = None, name: str = ""
    ):
        """A wrapper that opens a phase with ``begin()`` (a falsy result: not
        recording) and closes it with ``end(token)`` -- or, without ``end``, closes
        the phase ``name`` -- the user's call between."""

        def wrapper(wrapped, instance, args, kwargs):
            token = None
            try:
                if tracker.step is not None and (tracker.thread == _get_ident() or tracker.on_training_thread()):
                    token = begin()
            except Exception as exc:
                on_error(component, exc)
            if not token:
                return wrapped(*args, **kwargs)
            try:
                return wrapped(*args, **kwargs)
            except BaseException as exc:
                _mark_error(tracker, exc)
                raise
            finally:
                try:
                    if end is None:
                        tracker.end_phase(name)
                    else:
                        end(token)
                except Exception as exc:
                    on_error(component, exc)

        return wrapper

    def named_phase(name: str, component: str, begin=None):
        return phase_wrapper(component, begin or (lambda: tracker.begin_phase(name, auto=True)), name=name)

    # -- DataLoader ---------------------------------------------------------------
    from torch.utils.data import dataloader as dl

    def iter_wrapper(wrapped, instance, args, kwargs):
        started = None
        try:
            if tracker.on_training_thread():
                started = tracker.loader_iter_begin()
        except Exception as exc:
            on_error("dataloader", exc)
        it = wrapped(*args, **kwargs)
        if started is not None:
            try:
                started = started + (tracker.now(),)  # (token, start ns, end ns) of the start-up
            except Exception as exc:
                started = None
                on_error("dataloader", exc)
            try:
                wrappers.discover(sys._getframe(1))  # a generator wrapping the loader's loop?
            except Exception as exc:
                on_error("dataloader", exc)
        try:
            counts = instance.__dict__.setdefault("_otel_epochs", [0])
            if not counts[0]:  # this loader's first loop: its settings, once
                try:
                    tracker.facts.loader(instance)
                except Exception as exc:
                    on_error("dataloader", exc)
            it._otel_epoch = counts[0]
            counts[0] += 1
            if started is not None:
                it._otel_started = started
        except Exception:
            pass  # an iterator without __dict__: no epoch, no start-up time
        return it

    def next_wrapper(wrapped, instance, args, kwargs):
        recording = False
        try:
            if tracker.thread == _get_ident() or tracker.on_training_thread():
                state = getattr(instance, "__dict__", None)
                started = state.pop("_otel_started", None) if state else None
                recording = tracker.loader_next_begin(instance, started)
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
                tracker.loader_stopped(bool(watched_loops) and id(sys._getframe(2)) in watched_loops)
            except Exception as exc:
                on_error("dataloader", exc)
            raise
        except BaseException as exc:
            _mark_error(tracker, exc)
            try:
                tracker.end_phase(sc.PHASE_DATALOADER_NEXT)
            except Exception as exc2:
                on_error("dataloader", exc2)
            raise
        try:
            tracker.loader_next_end(batch)
        except Exception as exc:
            on_error("dataloader", exc)
        return batch

    patcher.wrap(dl.DataLoader, "__iter__", iter_wrapper)
    patcher.wrap_plain(dl._BaseDataLoaderIter, "__next__", next_wrapper)  # every step: no wrapt

    # -- backward -------------------------------------------------------------------
    patcher.wrap_plain(
        torch.autograd, "backward", named_phase(sc.PHASE_BACKWARD, "backward", lambda: tracker.backward_begin())
    )

    # -- optimizer step: torch's global hooks, not patches ------------------------------
    from torch.optim import optimizer as optim_mod

    def opt_pre(optimizer, args, kwargs):
        if _is_compiling():  # a compiled optimizer step: stay out of the graph
            return
        try:
            if tracker.thread == _get_ident() or tracker.on_training_thread(True):
                # args[0] is the optimizer: plain opt.step() has no closure
                closure = (len(args) > 1 or kwargs) and _closure_of(args, kwargs) is not None
                if closure:
                    tracker.closure_step_begin()
                tracker.optimizer_pre(optimizer, sys._getframe(1))
                if closure and tracker.step is not None:
                    return _with_wrapped_closure(tracker, optimizer, args, kwargs)
        except Exception as exc:
            on_error("optimizer", exc)
        return None

    def opt_init(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        try:
            tracker.assembler.optimizers.add(instance)
            tracker.facts.optimizer(instance)
        except Exception as exc:
            on_error("optimizer", exc)
        return result

    def opt_post(optimizer, args, kwargs):
        if _is_compiling():
            return
        try:
            if tracker.thread == _get_ident() or tracker.on_training_thread(True):
                tracker.optimizer_post(optimizer)
        except Exception as exc:
            on_error("optimizer", exc)

    handles.add(optim_mod.register_optimizer_step_pre_hook(opt_pre))
    handles.add(optim_mod.register_optimizer_step_post_hook(opt_post))
    # Optimizers alive decide what a step is: with one, backward passes without an
    # update are gradient accumulation (see step_assembly.py).
    patcher.wrap(optim_mod.Optimizer, "__init__", opt_init)

    # -- AMP: GradScaler.step is the optimizer step (its found-inf .item() included) --------
    # A step whose optimizer did not run (inf/NaN gradients) is still a step, marked skipped.
    def scaler_begin():
        step = tracker.step
        rec = tracker.optimizer_begin()
        return (rec, step, step.updates) if rec is not None else None

    def scaler_end(token):
        rec, step, updates = token
        tracker.end_record(rec)
        if step is tracker.step and step.updates == updates:
            step.skipped += 1

    scaler_step_wrapper = phase_wrapper("optimizer", scaler_begin, scaler_end)

    scaler_base = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if isinstance(scaler_base, type):
        for cls in _subclasses(scaler_base) | {scaler_base}:
            if "step" in vars(cls):
                patcher.wrap(cls, "step", scaler_step_wrapper)

    # -- LR schedulers: the base step and every subclass that overrides it ----------------
    from torch.optim import lr_scheduler as lrs

    lr_wrapper = named_phase(sc.PHASE_LR_SCHEDULERS, "lr_scheduler")
    base = getattr(lrs, "LRScheduler", None) or lrs._LRScheduler
    for cls in _subclasses(base) | {base, getattr(lrs, "ReduceLROnPlateau", base)}:
        if "step" in vars(cls):
            patcher.wrap(cls, "step", lr_wrapper)

    # -- device-to-host reads ---------------------------------------------------------
    for method in _FROM_DEVICE_METHODS:
        patcher.wrap(torch.Tensor, method, named_phase(sc.PHASE_FROM_DEVICE, "from_device"))

    # -- user collectives ----------------------------------------------------------------
    if torch.distributed.is_available():
        reduce_wrapper = named_phase(sc.PHASE_REDUCE_METRICS, "distributed")
        for name in _COLLECTIVES:
            if hasattr(torch.distributed, name):
                patcher.wrap(torch.distributed, name, reduce_wrapper)


# torch.compiler.is_compiling itself (dynamo folds it to True while tracing).
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
_get_ident = threading.get_ident


def _closure_of(args: tuple, kwargs: dict) -> Any:
    closure = kwargs.get("closure")
    if closure is None and len(args) > 1 and callable(args[1]):
        closure = args[1]
    return closure


def _with_wrapped_closure(tracker: Any, optimizer: Any, args: tuple, kwargs: dict):
    """New (args, kwargs) for torch's pre-hook protocol when a closure was passed."""
    if kwargs.get("closure") is not None:
        kwargs = dict(kwargs)
        kwargs["closure"] = tracker.wrap_closure(optimizer, kwargs["closure"])
        return args, kwargs
    if len(args) > 1 and callable(args[1]):
        return (args[0], tracker.wrap_closure(optimizer, args[1])) + tuple(args[2:]), kwargs
    return None


def _subclasses(cls) -> set:
    out, todo = set(), [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


def _mark_error(tracker: Any, exc: BaseException) -> None:
    try:
        tracker.record_error(exc)
    except Exception:  # pragma: no cover - the user's exception goes on regardless
        pass
