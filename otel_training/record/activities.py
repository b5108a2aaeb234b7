"""Work that is no training, found zero-code: checkpoint saves and loads, and
``torch.compile``'s compilations.

Each is an interval on the training thread, appended to an ``ActivityLog`` when it
ends; the pipeline's ``JobClock`` (aggregate/job.py) takes its time out of the step
or the time between steps it lies in. Nothing here runs on the per-step path: the
wrappers run only when the user's program calls a checkpoint function, and
compilation is announced by torch's own compile events
(``torch._dynamo.callback``, the same events its compile-time counters time), listened
to from when ``torch.compile`` imports dynamo.

Checkpoint functions: ``torch.save``/``torch.load``; ``torch.distributed.checkpoint``'s
``save``, ``async_save`` (the blocking part: staging), ``load`` and the older
``save_state_dict``/``load_state_dict``; safetensors' ``save_file``/``load_file``/
``save_model``/``load_model``; transformers' ``save_pretrained``/``from_pretrained`` and
the ``Trainer``'s checkpoint save and resume; Lightning's ``Trainer.save_checkpoint``
and Fabric's ``save``/``load``. Calls nested in one another (``save_pretrained``
writing through safetensors) are one interval, the outermost. A ``torch.load`` inside
a DataLoader wait is data loading (a dataset of ``.pt`` files), not a checkpoint.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from otel_training import semconv as sc
from otel_training.handles import Handles, Patch
from otel_training.record.global_step import GlobalStep
from otel_training.record.import_hooks import ModuleHooks

CHECKPOINT = "checkpoint"
COMPILE = "compile"
SAVE, LOAD = "save", "load"
# What a compilation was, from torch's compile id (``frame/attempt``) and trigger.
FIRST, RECOMPILE, BACKWARD, UNKNOWN = "compile", "recompile", "backward", "unknown"
_MAX_PENDING = 100_000  # intervals the pipeline has not taken yet (a stalled pipeline: dropped)
_MAIN = threading.main_thread().ident
_get_ident = threading.get_ident
_clock = time.perf_counter_ns

# module -> ((owner attribute or "", function, label, save/load), ...); "" patches a
# module-level function. Hooked when the module is imported (at once if it is).
FRAMEWORKS: dict[str, tuple[tuple[str, str, str, str], ...]] = {
    "torch.distributed.checkpoint": (
        ("", "save", "torch.distributed.checkpoint.save", SAVE),
        ("", "async_save", "torch.distributed.checkpoint.async_save", SAVE),
        ("", "save_state_dict", "torch.distributed.checkpoint.save_state_dict", SAVE),
        ("", "load", "torch.distributed.checkpoint.load", LOAD),
        ("", "load_state_dict", "torch.distributed.checkpoint.load_state_dict", LOAD),
    ),
    "safetensors.torch": (
        ("", "save_file", "safetensors.save_file", SAVE),
        ("", "save_model", "safetensors.save_model", SAVE),
        ("", "load_file", "safetensors.load_file", LOAD),
        ("", "load_model", "safetensors.load_model", LOAD),
    ),
    "transformers.modeling_utils": (
        ("PreTrainedModel", "save_pretrained", "save_pretrained", SAVE),
        ("PreTrainedModel", "from_pretrained", "from_pretrained", LOAD),
    ),
    "transformers.trainer": (
        ("Trainer", "_save_checkpoint", "transformers.Trainer checkpoint", SAVE),
        ("Trainer", "save_model", "transformers.Trainer.save_model", SAVE),
        ("Trainer", "_load_from_checkpoint", "transformers.Trainer resume", LOAD),
        ("Trainer", "_load_optimizer_and_scheduler", "transformers.Trainer resume", LOAD),
    ),
    "lightning.pytorch.trainer.trainer": (("Trainer", "save_checkpoint", "lightning.Trainer.save_checkpoint", SAVE),),
    "pytorch_lightning.trainer.trainer": (("Trainer", "save_checkpoint", "lightning.Trainer.save_checkpoint", SAVE),),
    "lightning.fabric.fabric": (
        ("Fabric", "save", "lightning.Fabric.save", SAVE),
        ("Fabric", "load", "lightning.Fabric.load", LOAD),
    ),
    "lightning_fabric.fabric": (
        ("Fabric", "save", "lightning.Fabric.save", SAVE),
        ("Fabric", "load", "lightning.Fabric.load", LOAD),
    ),
}
_HOOKS = ModuleHooks(FRAMEWORKS, CHECKPOINT)
# torch's compile events, once dynamo is imported (by torch.compile): importing it here
# would add seconds to every instrumented process's start-up.
_COMPILE_EVENTS = "torch._dynamo.callback"
_COMPILE_HOOKS = ModuleHooks((_COMPILE_EVENTS,), COMPILE)


class Interval(NamedTuple):
    kind: str  # CHECKPOINT or COMPILE
    start: int  # host ns (perf_counter_ns), the tracker's clock
    end: int
    what: str  # the function called ("torch.save"), or torch's compile id
    op: str  # checkpoint: SAVE / LOAD; compile: FIRST / RECOMPILE / BACKWARD / UNKNOWN
    step: int | None = None  # a save: the framework's global step (record/global_step.py)


class ActivityLog:
    """Intervals in the order they ended: appended on the training thread, taken from
    the front by the pipeline thread (``deque``: both ends are thread-safe)."""

    def __init__(self) -> None:
        self.items: deque[Interval] = deque()
        self.dropped = 0

    def add(self, interval: Interval) -> None:
        if len(self.items) >= _MAX_PENDING:
            self.dropped += 1
            return
        self.items.append(interval)


def compile_op(args: tuple) -> tuple[str, str]:
    """(compile id, FIRST / RECOMPILE / BACKWARD / UNKNOWN) from a compile event's
    arguments: torch 2.6 on passes ``CallbackArgs(callback_trigger, compile_id)``, with
    ids ``"<frame>/<attempt>"`` (attempt 0: the frame's first compilation); earlier
    releases pass nothing."""
    info = args[0] if args else None
    compile_id = str(getattr(info, "compile_id", "") or "")
    trigger = getattr(getattr(info, "callback_trigger", None), "name", "")
    if trigger and trigger != "DYNAMO":
        return compile_id, BACKWARD if trigger == "LAZY_BACKWARD" else UNKNOWN
    try:
        attempt = int(compile_id.rsplit("/", 1)[1].split("_", 1)[0])
    except (IndexError, ValueError):
        return compile_id, UNKNOWN
    return compile_id, RECOMPILE if attempt > 0 else FIRST


class Activities:
    """Times checkpoint calls and compilations on the training thread into ``log``."""

    def __init__(
        self,
        tracker: Any,
        log: ActivityLog,
        on_error: Callable[[str, BaseException], None],
        global_step: GlobalStep | None = None,
        on_save: Callable[[], None] | None = None,
    ) -> None:
        self._tracker = tracker
        self.log = log
        self._global_step = global_step
        self._on_save = on_save  # after each save (a restarted run's record is rewritten)
        self._on_error = on_error
        self._patches = Handles()
        self._depth = 0  # open intervals on the training thread (nested calls: the outermost counts)
        self._compile: tuple[int, str, str] | None = None  # (start, id, op) of the compilation under way
        self._callbacks: Any = None  # torch's compile callback handler, once registered

    def install(self) -> Activities:
        import torch

        for label, name in (("torch.save", "save"), ("torch.load", "load")):
            self._patches.wrap(torch, name, self._timed(label, SAVE if name == "save" else LOAD))
        _HOOKS.install(self, self._on_module, self._on_error)
        _COMPILE_HOOKS.install(self, self._register_compile_events, self._on_error)
        return self

    def remove(self) -> None:
        _HOOKS.remove(self)
        _COMPILE_HOOKS.remove(self)
        self._patches.remove()
        handler, self._callbacks = self._callbacks, None
        if handler is not None:
            for callbacks, callback in (
                (handler.start_callbacks, self._compile_start),
                (handler.end_callbacks, self._compile_end),
            ):
                try:
                    callbacks.remove(callback)  # (what remove_start_callback does, in every release)
                except ValueError:  # cleared by someone else
                    pass

    # -- which thread ----------------------------------------------------------------
    def _ours(self) -> bool:
        """On the training thread (until one is known, the main thread), without
        making this thread the training thread."""
        thread = self._tracker.thread
        ident = _get_ident()
        return ident == thread if thread is not None else ident == _MAIN

    def _in_data_wait(self) -> bool:
        """Inside a DataLoader wait of the open step: a dataset reading its files."""
        tracker = self._tracker
        if tracker.step is None:
            return False
        # The open phases: the tracker's phase stack (``phases.stack``), or its own list.
        stack: Any = getattr(getattr(tracker, "phases", None), "stack", None)
        if stack is None:
            stack = getattr(tracker, "_stack", None)
        return bool(stack) and stack[-1].name == sc.PHASE_DATALOADER_NEXT

    # -- checkpoints -------------------------------------------------------------------
    def _on_module(self, module: Any) -> None:
        for owner_name, name, label, op in FRAMEWORKS.get(module.__name__, ()):
            owner = getattr(module, owner_name, None) if owner_name else module
            if owner is None:
                continue
            if isinstance(getattr(owner, "__dict__", {}).get(name), classmethod):
                self._wrap_classmethod(owner, name, self._timed(label, op))
            else:
                self._patches.wrap(owner, name, self._timed(label, op))

    def _wrap_classmethod(self, owner: type, name: str, wrapper: Callable) -> None:
        """``Handles.wrap`` for a classmethod (``from_pretrained``): the same wrapper
        protocol, the classmethod object put back on ``remove``."""
        original = vars(owner)[name]
        func = original.__func__
        if getattr(func, "_otel_patch", False):
            return

        @functools.wraps(func)
        def patched(cls: Any, *args: Any, **kwargs: Any) -> Any:
            return wrapper(functools.partial(func, cls), cls, args, kwargs)

        patched._otel_patch = True  # type: ignore[attr-defined]
        setattr(owner, name, classmethod(patched))
        self._patches.add(Patch(owner, name, original))

    def _timed(self, label: str, op: str) -> Callable:
        activities = self

        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            counted = False
            start = 0
            try:
                if activities._ours():
                    if activities._depth:  # inside another interval: part of it
                        activities._depth += 1
                        counted = True
                    elif not (op == LOAD and activities._in_data_wait()):
                        activities._depth = 1
                        counted = True
                        start = _clock()
            except Exception as exc:  # our bug: never the user's problem
                activities._on_error(CHECKPOINT, exc)
            if not counted:
                return wrapped(*args, **kwargs)
            try:
                return wrapped(*args, **kwargs)
            finally:
                try:
                    activities._depth -= 1
                    if start and not activities._depth:
                        end = _clock()
                        gs = activities._global_step
                        step = gs.current() if gs is not None and op == SAVE else None
                        activities.log.add(Interval(CHECKPOINT, start, end, label, op, step))
                        if op == SAVE and activities._on_save is not None:
                            activities._on_save()
                except Exception as exc:
                    activities._on_error(CHECKPOINT, exc)

        return wrapper

    # -- compilation -------------------------------------------------------------------
    def _register_compile_events(self, module: Any) -> None:
        """``torch._dynamo.callback`` was imported: time compilations from now on."""
        handler = getattr(module, "callback_handler", None)
        if handler is None or self._callbacks is not None:
            return
        handler.register_start_callback(self._compile_start)
        handler.register_end_callback(self._compile_end)
        self._callbacks = handler

    def _compile_start(self, *args: Any) -> None:
        try:
            if not self._ours():
                return
            if self._depth:  # a compilation inside a checkpoint call (or another): part of it
                self._depth += 1
                return
            compile_id, op = compile_op(args)
            self._depth = 1
            self._compile = (_clock(), compile_id, op)
        except Exception as exc:
            self._on_error(COMPILE, exc)

    def _compile_end(self, *args: Any) -> None:
        try:
            if not self._ours() or not self._depth:
                return
            self._depth -= 1
            if self._depth or self._compile is None:
                return
            start, compile_id, op = self._compile
            self._compile = None
            self.log.add(Interval(COMPILE, start, _clock(), compile_id, op))
        except Exception as exc:
            self._on_error(COMPILE, exc)
