"""Symmetric wrap/unwrap of attributes, restoring each patched object exactly."""

from __future__ import annotations

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
        original = vars(owner).get(name, _MISSING)
        target = getattr(owner, name, _MISSING)
        if target is _MISSING or isinstance(target, wrapt.ObjectProxy):
            return False  # absent in this torch, or already ours
        if original is not _MISSING and isinstance(original, (staticmethod, classmethod)):
            return False
        setattr(owner, name, wrapt.FunctionWrapper(target, wrapper))
        self._undo.append((owner, name, original))
        return True

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
