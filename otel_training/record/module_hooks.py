"""Forward timing with hooks on *root* modules only.

A global forward pre-hook is armed only while discovering: a module called when
no root forward is running is a root (the model, a loss module, a DDP or
``torch.compile`` wrapper). Roots get instance hooks; the global hook is then
removed, so per-step cost does not grow with the number of submodules. It is
re-armed after a step that saw no root forward (a new model appeared).

A root is timed by an instance ``_call_impl`` (what ``Module.__call__`` runs)
that opens and closes the forward phase around torch's own: registering forward
hooks instead would send every root call down torch's slow hook path, which
costs more than the timing itself.

Compiled modules: the discovery hook is lifted while a compiled module runs, so
dynamo never sees (nor guards on, nor warns about) it -- no recompile when it is
removed after the first step. ``torch.compile(module)`` wrappers are made roots as
they are called; a ``module.compile()``'d module runs its hooks inside the
compiled code, where they cannot time anything, so its compiled call is wrapped
instead (restored on uninstrument).

Copies: a root's timed call is bound to live state (the tracker, its threads),
so ``copy.deepcopy(model)`` or pickling a root (``torch.save(model)``) would try
to copy that state and fail. ``Module.__getstate__`` -- the state both use -- is
wrapped to leave it out: a copy is a plain module again.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch
from torch.nn.modules import module as _module

from otel_training.handles import Handles
from otel_training.record.events import DRIVER_NONE, TrainingEvents
from otel_training.record.import_hooks import ModuleHooks
from otel_training.semconv import PHASE_FORWARD as _FORWARD

# torch.compiler.is_compiling itself (dynamo folds it to True while tracing).
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
_get_ident = threading.get_ident


_EVAL_FRAME = "torch._dynamo.eval_frame"
# torch.compile's wrapper class is patched when dynamo is imported (by the program's first
# torch.compile, usually): importing it at install would add about a second to every
# instrumented process's start-up, compiled or not.
_DYNAMO = ModuleHooks((_EVAL_FRAME,), "forward")


def _optimized_module_class():
    """torch.compile's wrapper class, once dynamo is imported (before, no module is one)."""
    return getattr(sys.modules.get(_EVAL_FRAME), "OptimizedModule", None)


_CALL = "_call_impl"


def _is_loss(module) -> bool:
    """A module without parameters: a loss (or a parameter-free wrapper)."""
    try:
        return next(iter(module.parameters()), None) is None
    except Exception:
        return False


def _call_kwargs(module) -> dict | None:
    """The keyword arguments of the call a global pre-hook runs in (``model(**batch)``
    at discovery: the hook gets only the positional ones): torch's ``_call_impl``
    frame, which runs the hook, holds them. Once per discovered root."""
    try:
        frame: Any = sys._getframe(2)  # _discover <- torch's inner() <- _call_impl
        for _ in range(3):
            if frame is None:
                break
            if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is module:
                kwargs = frame.f_locals.get("kwargs")
                return kwargs if isinstance(kwargs, dict) else None
            frame = frame.f_back
    except Exception:
        pass
    return None


def _first_input(args: tuple, kwargs: dict | None) -> Any:
    """A call's first argument (its first keyword argument when it has none)."""
    if args:
        return args[0]
    return next(iter(kwargs.values()), None) if kwargs else None


def _computes_nothing(first: Any) -> bool:
    """A call on ``meta`` tensors or on Keras's symbolic ``KerasTensor``s: a pass that
    infers shapes (Keras builds a model so, and runs it once so before training)."""
    return getattr(first, "is_meta", False) is True or type(first).__name__ == "KerasTensor"


def _restore(state: dict, call, prev) -> None:
    """Put back, in ``state``, the call a root had before our timed ``call``."""
    if state.get(_CALL) is call:
        if prev is None:
            del state[_CALL]
        else:
            state[_CALL] = prev


class RootModuleHooks:
    def __init__(self, events: TrainingEvents, on_error) -> None:
        self._events = events
        self._facts = events.facts  # the run's device, autocast, compiled (record/run_facts.py)
        self._on_error = on_error
        self._roots: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()
        self._compiled: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._discovery: Any = None  # torch's RemovableHandle while armed
        self._want_armed = False
        self._suspended = 0
        self.depth = 0
        self._meta = False  # the running root call is on meta tensors (no step)
        self.step_saw_root = False
        self._patches = Handles()
        self._patch_compile()
        self._patch_getstate()

    # -- discovery -------------------------------------------------------------
    def arm(self) -> None:
        self._want_armed = True
        if self._discovery is None and not self._suspended:
            self._discovery = _module.register_module_forward_pre_hook(self._discover)

    def disarm(self) -> None:
        self._want_armed = False
        self._lift()

    def _lift(self) -> None:
        if self._discovery is not None:
            self._discovery.remove()
            self._discovery = None

    def _suspend(self) -> bool:
        """Lift the discovery hook while a compiled module runs; True if lifted."""
        if not self._want_armed:
            return False
        self._suspended += 1
        self._lift()
        return True

    def _resume(self) -> None:
        self._suspended -= 1
        if not self._suspended and self._want_armed:
            self.arm()

    def _add_root(self, module) -> None:
        state = module.__dict__  # not setattr: OptimizedModule forwards it to the inner module
        prev = state.get(_CALL)  # another tool's instance call: ours runs around it
        call = self._timed_call(module, prev, lift=False)
        state[_CALL] = call
        self._roots[module] = (call, prev)
        try:
            self._facts.root(module, _optimized_module_class())
        except Exception as exc:
            self._on_error("forward", exc)

    def _discover(self, module, args):
        if _is_compiling() or self.depth:
            return None
        try:
            events = self._events
            if module in self._roots or not events.on_training_thread(True) or events.in_backward():
                return None  # (a module a backward pass recomputes is no root: checkpointing)
            if _computes_nothing(_first_input(args, {})):
                return None  # a shape pass (Keras building a model): no root, no step
            self._add_root(module)
            # This call is already past our timed call: time it with a one-shot hook.
            if self._begin(module, _is_loss(module), args, _call_kwargs(module)):
                once: Any = None

                def end_once(mod, args, output):
                    once.remove()
                    self._end(sys.exc_info()[1])

                once = module.register_forward_hook(end_once, always_call=True)
        except Exception as exc:  # our bug: never the user's problem
            self._on_error("forward", exc)
        return None

    # -- timing a root's call ---------------------------------------------------------
    def _begin(self, module, loss: bool = False, args: tuple = (), kwargs: dict | None = None) -> bool:
        """A root call begins; True if it is the training thread's (``_end`` follows).
        ``loss``: the root has no parameters (a loss module); ``args``, ``kwargs``: its
        inputs (samples and tokens are read from them when no DataLoader drives)."""
        events = self._events
        ours = False
        try:
            if events.thread != _get_ident() and not events.on_training_thread(True):
                return False  # another thread's forward: not ours, nor our depth
            self.depth += 1
            ours = True
            if self.depth == 1:
                first = args[0] if args else _first_input(args, kwargs)
                if getattr(first, "is_meta", False) is True:
                    # A pass on ``meta`` tensors computes nothing (Keras infers shapes so
                    # before training): no step, no forward; its submodules stay inside it.
                    self._meta = True
                    return ours
                self.step_saw_root = True
                facts = self._facts
                facts.forwards += 1
                if facts.forwards == facts.autocast_at:  # until an autocast region is seen
                    facts.check_autocast()
                events.forward_begin(module, loss)
                if not loss and events.driver == DRIVER_NONE:
                    events.forward_inputs(module, args, kwargs)
        except Exception as exc:
            self._on_error("forward", exc)
        return ours

    def _end(self, error) -> None:
        """The root call ``_begin`` counted ended (``error``: what it raised)."""
        events = self._events
        try:
            if self.depth > 0:
                self.depth -= 1
            if self.depth == 0:
                if self._meta:
                    self._meta = False
                    return
                if error is not None:
                    events.record_error(error)
                events.end_phase(_FORWARD)
        except Exception as exc:
            self._on_error("forward", exc)

    def _timed_call(self, module, inner, lift: bool):
        """A root's call, timed: ``inner(*args, **kwargs)`` -- or, when None, torch's
        ``_call_impl`` -- between ``_begin`` and ``_end``. ``lift``: discovery is
        lifted meanwhile (a compiled module). The module is held weakly: no cycle
        keeps a dropped model alive."""
        hooks = self
        ref = weakref.ref(module)
        impl = type(module)._call_impl
        loss = _is_loss(module)  # decided once: the tracker merges a loss into the forward

        def call(*args, **kwargs):
            mod = ref()
            if _is_compiling():  # inside compiled code: stay out of the graph
                return impl(mod, *args, **kwargs) if inner is None else inner(*args, **kwargs)
            lifted = lift and hooks._suspend()
            ours = hooks._begin(mod, loss, args, kwargs)
            try:
                result = impl(mod, *args, **kwargs) if inner is None else inner(*args, **kwargs)
            except BaseException as exc:
                if ours:
                    hooks._end(exc)  # marks the step
                if lifted:
                    hooks._resume()
                raise
            if ours:
                hooks._end(None)
            if lifted:
                hooks._resume()
            return result

        return call

    # -- copies and pickles ----------------------------------------------------------
    def _patch_getstate(self) -> None:
        hooks = self

        def getstate(wrapped, instance, args, kwargs):
            state = wrapped(*args, **kwargs)
            try:
                entry = hooks._roots.get(instance)
                if entry is not None and isinstance(state, dict) and state.get(_CALL) is entry[0]:
                    if state is instance.__dict__:
                        state = dict(state)
                    _restore(state, *entry)
            except Exception as exc:
                hooks._on_error("forward", exc)
            return state

        if "__getstate__" in vars(torch.nn.Module):
            self._patches.wrap(torch.nn.Module, "__getstate__", getstate)

    # -- compiled modules ----------------------------------------------------------
    def _patch_compile(self) -> None:
        hooks = self

        def optimized_call(wrapped, instance, args, kwargs):
            # torch.compile(module): a root as soon as it runs at top level (its
            # instance hooks run eagerly, outside the compiled forward).
            lifted = False
            try:
                if not _is_compiling():
                    if not hooks.depth and instance not in hooks._roots and hooks._events.on_training_thread(True):
                        hooks._add_root(instance)
                    lifted = hooks._suspend()
            except Exception as exc:
                hooks._on_error("forward", exc)
            if not lifted:
                return wrapped(*args, **kwargs)
            try:
                return wrapped(*args, **kwargs)
            finally:
                hooks._resume()

        def compile_method(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            try:
                inner = instance.__dict__.get("_compiled_call_impl")
                if inner is not None and getattr(inner, "_otel_inner", None) is None:
                    instance._compiled_call_impl = hooks._compiled_caller(instance, inner)
                    hooks._compiled.add(instance)
                    hooks._facts.compiled = True
            except Exception as exc:
                hooks._on_error("forward", exc)
            return result

        def on_dynamo(module) -> None:
            cls = getattr(module, "OptimizedModule", None)
            if cls is not None and "__call__" in vars(cls):
                hooks._patches.wrap(cls, "__call__", optimized_call)

        _DYNAMO.install(self, on_dynamo, self._on_error)
        if "compile" in vars(torch.nn.Module):
            self._patches.wrap(torch.nn.Module, "compile", compile_method)

    def _compiled_caller(self, module, inner):
        """The call of a ``module.compile()``'d module: root timing around it."""
        call = self._timed_call(module, inner, lift=True)
        call._otel_inner = inner
        return call

    def on_step_end(self) -> None:
        """Called by the runtime after each step: re-arm discovery when needed."""
        if self.step_saw_root:
            if self._want_armed or self._discovery is not None:
                self.disarm()
        else:
            self.arm()
        self.step_saw_root = False
        self.depth = 0
        self._meta = False

    def has_compiled(self) -> bool:
        """Whether a compiled module (``torch.compile``, ``module.compile()``) was seen."""
        cls = _optimized_module_class()
        return bool(self._compiled) or (cls is not None and any(isinstance(m, cls) for m in self._roots.keys()))

    def roots(self) -> list:
        return list(self._roots.keys()) + [m for m in self._compiled if m not in self._roots]

    def remove(self) -> None:
        self.disarm()
        for module, entry in list(self._roots.items()):
            _restore(module.__dict__, *entry)
        self._roots = weakref.WeakKeyDictionary()
        for module in list(self._compiled):
            call = module.__dict__.get("_compiled_call_impl")
            inner = getattr(call, "_otel_inner", None)
            if inner is not None:
                module._compiled_call_impl = inner
        self._compiled = weakref.WeakSet()
        _DYNAMO.remove(self)
        self._patches.remove()
