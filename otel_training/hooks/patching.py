"""Symmetric wrap/unwrap of attributes, restoring each patched object exactly."""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Tuple

import wrapt

_MISSING = object()


class Patcher:
    """Wraps attributes with ``wrapt`` and undoes every wrap in reverse order.

    An attribute that was inherited (absent from the owner's ``__dict__``) is
    deleted on undo rather than re-set, so the owner ends exactly as it began.
    """

    def __init__(self) -> None:
        self._undo: List[Tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, wrapper: Callable) -> bool:
        """Replace ``owner.name`` by a ``wrapt`` wrapper calling
        ``wrapper(wrapped, instance, args, kwargs)``; False if absent or already ours."""
        original, target = self._target(owner, name)
        if target is _MISSING:
            return False
        setattr(owner, name, wrapt.FunctionWrapper(target, wrapper))
        self._undo.append((owner, name, original))
        return True

    def wrap_plain(self, owner: Any, name: str, wrapper: Callable) -> bool:
        """``wrap`` for the hottest calls (every step): a plain function, which
        costs a fraction of a ``wrapt`` wrapper's call. Same ``wrapper`` protocol;
        ``owner`` a class (``name`` a method) or a module (a function)."""
        original, target = self._target(owner, name)
        if target is _MISSING:
            return False
        if isinstance(owner, type):
            def patched(self, *args, **kwargs):
                return wrapper(target.__get__(self), self, args, kwargs)
        else:
            def patched(*args, **kwargs):
                return wrapper(target, None, args, kwargs)
        functools.update_wrapper(patched, target)
        patched._otel_patch = True
        setattr(owner, name, patched)
        self._undo.append((owner, name, original))
        return True

    @staticmethod
    def _target(owner: Any, name: str) -> Tuple[Any, Any]:
        """(what ``owner.__dict__`` holds, what to wrap); the latter _MISSING when
        absent in this torch, already ours, or a static/class method."""
        original = vars(owner).get(name, _MISSING)
        target = getattr(owner, name, _MISSING)
        if isinstance(target, wrapt.ObjectProxy) or getattr(target, "_otel_patch", False):
            return original, _MISSING
        if original is not _MISSING and isinstance(original, (staticmethod, classmethod)):
            return original, _MISSING
        return original, target

    def undo(self) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            if original is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, original)

    def __len__(self) -> int:
        return len(self._undo)
