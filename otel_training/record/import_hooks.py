"""Patching classes of modules the user's program may import later.

wrapt's post-import hooks cannot be removed, so each module name is hooked once per
process, and the hook calls whichever owner is installed now: an uninstrumented
process's later imports patch nothing, and instrumenting again patches anew.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import wrapt

OnModule = Callable[[Any], None]
OnError = Callable[[str, BaseException], None]


class ModuleHooks:
    """``on_module(module)`` for each of ``names``: at once for those imported, else
    when they are; errors go to ``on_error`` (never to the user's import)."""

    def __init__(self, names: Iterable[str], component: str) -> None:
        self._names = tuple(names)
        self._component = component
        self._lock = threading.Lock()
        self._registered: set[str] = set()
        self._current: tuple[Any, OnModule, OnError] | None = None

    def install(self, owner: Any, on_module: OnModule, on_error: OnError) -> None:
        with self._lock:
            self._current = (owner, on_module, on_error)
            for name in self._names:
                if name not in self._registered:
                    self._registered.add(name)
                    wrapt.register_post_import_hook(self._on_import, name)  # at once if imported
                elif name in sys.modules:  # hooked in an earlier install: patch now
                    self._call(on_module, on_error, sys.modules[name])

    def remove(self, owner: Any) -> None:
        with self._lock:
            if self._current is not None and self._current[0] is owner:
                self._current = None

    def _on_import(self, module: Any) -> None:
        current = self._current
        if current is not None:
            self._call(current[1], current[2], module)

    def _call(self, on_module: OnModule, on_error: OnError, module: Any) -> None:
        try:
            on_module(module)
        except Exception as exc:  # never break the user's import
            on_error(self._component, exc)
