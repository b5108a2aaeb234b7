"""Forward timing with hooks on *root* modules only.

A global forward pre-hook is armed only while discovering: a module called when
no root forward is running is a root (the model, a loss module, a DDP or
``torch.compile`` wrapper). Roots get instance hooks; the global hook is then
removed, so per-step cost does not grow with the number of submodules. It is
re-armed after a step that saw no root forward (a new model appeared).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.nn.modules import module as _module


def _is_compiling() -> bool:
    fn = getattr(torch.compiler, "is_compiling", None)
    return bool(fn and fn())


class RootModuleHooks:
    def __init__(self, tracker: Any, on_error) -> None:
        self._tracker = tracker
        self._on_error = on_error
        self._roots: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
        self._discovery = None
        self.depth = 0
        self.step_saw_root = False

    # -- discovery -------------------------------------------------------------
    def arm(self) -> None:
        if self._discovery is None:
            self._discovery = _module.register_module_forward_pre_hook(self._discover)

    def disarm(self) -> None:
        if self._discovery is not None:
            self._discovery.remove()
            self._discovery = None

    @property
    def armed(self) -> bool:
        return self._discovery is not None

    def _discover(self, module, args):
        if _is_compiling() or self.depth:
            return None
        try:
            if module in self._roots or not self._tracker.on_training_thread():
                return None
            pre = module.register_forward_pre_hook(self._pre)
            post = module.register_forward_hook(self._post, always_call=True)
            self._roots[module] = (pre, post)
            # Instance pre-hooks added now are not run for this call: run ours.
            self._pre(module, args)
        except Exception as exc:  # our bug: never the user's problem
            self._on_error("forward", exc)
        return None

    # -- per-root hooks -----------------------------------------------------------
    def _pre(self, module, args):
        if _is_compiling():
            return None
        self.depth += 1
        if self.depth == 1:
            try:
                tracker = self._tracker
                if tracker.on_training_thread():
                    self.step_saw_root = True
                    tracker.forward_begin()
            except Exception as exc:
                self._on_error("forward", exc)
        return None

    def _post(self, module, args, output):
        if _is_compiling():
            return None
        if self.depth > 0:
            self.depth -= 1
        if self.depth == 0:
            try:
                tracker = self._tracker
                if tracker.on_training_thread():
                    exc = sys.exc_info()[1]
                    if exc is not None and tracker.step is not None:
                        tracker.step.error = exc
                    tracker.forward_end()
            except Exception as exc:
                self._on_error("forward", exc)
        return None

    def on_step_end(self) -> None:
        """Called by the runtime after each step: re-arm discovery when needed."""
        if self.step_saw_root:
            self.disarm()
        else:
            self.arm()
        self.step_saw_root = False
        self.depth = 0

    def roots(self) -> list:
        return list(self._roots.keys())

    def remove(self) -> None:
        self.disarm()
        for pre, post in list(self._roots.values()):
            pre.remove()
            post.remove()
        self._roots = weakref.WeakKeyDictionary()
