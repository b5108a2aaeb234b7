"""Handles: every attachment of ours (a patched attribute, a torch hook, a wrapped
SDK exporter, a post-import hook) can be removed, like torch's ``RemovableHandle``.

``Handles`` keeps them in the order made; ``remove()`` undoes them in reverse. A
patched attribute is restored exactly: one that was inherited (absent from the
owner's ``__dict__``) is deleted again rather than re-set.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import wrapt

_MISSING = object()


class Handle(Protocol):
    def remove(self) -> None: ...


class Patch:
    """``owner.name`` replaced by our wrapper; ``remove()`` puts the original back."""

    __slots__ = ("owner", "name", "original")

    def __init__(self, owner: Any, name: str, original: Any) -> None:
        self.owner = owner
        self.name = name
        self.original = original  # what ``owner.__dict__`` held (_MISSING: inherited)

    def remove(self) -> None:
        if self.original is _MISSING:
            try:
                delattr(self.owner, self.name)
            except AttributeError:
                pass
        else:
            setattr(self.owner, self.name, self.original)

    def __repr__(self) -> str:
        return f"Patch({getattr(self.owner, '__name__', self.owner)!r}.{self.name})"


class Undo:
    """A handle around an undo function, run at most once."""

    __slots__ = ("_undo", "name")

    def __init__(self, undo: Callable[[], Any], name: str = "") -> None:
        self._undo: Callable[[], Any] | None = undo
        self.name = name

    def remove(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def __repr__(self) -> str:
        return f"Undo({self.name!r})"


class Handles:
    """Attachments in the order made; ``remove()`` undoes them in reverse."""

    def __init__(self) -> None:
        self._items: list[Handle] = []

    def add(self, handle: Any) -> Any:
        """Keep ``handle`` (anything with ``remove()``; None is ignored); returns it."""
        if handle is not None:
            self._items.append(handle)
        return handle

    def on_remove(self, undo: Callable[[], Any], name: str = "") -> Undo:
        return self.add(Undo(undo, name))

    def wrap(self, owner: Any, name: str, wrapper: Callable) -> Patch | None:
        """Replace ``owner.name`` by a ``wrapt`` wrapper calling
        ``wrapper(wrapped, instance, args, kwargs)``; None if absent or already ours."""
        original, target = _target(owner, name)
        if target is _MISSING:
            return None
        setattr(owner, name, wrapt.FunctionWrapper(target, wrapper))
        return self.add(Patch(owner, name, original))

    def wrap_plain(self, owner: Any, name: str, wrapper: Callable) -> Patch | None:
        """``wrap`` for the hottest calls (every step): a plain function, which
        costs a fraction of a ``wrapt`` wrapper's call. Same ``wrapper`` protocol;
        ``owner`` a class (``name`` a method) or a module (a function)."""
        original, target = _target(owner, name)
        if target is _MISSING:
            return None
        patched: Callable[..., Any]
        if isinstance(owner, type):

            def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
                return wrapper(target.__get__(self), self, args, kwargs)
        else:

            def patched(*args: Any, **kwargs: Any) -> Any:
                return wrapper(target, None, args, kwargs)

        functools.update_wrapper(patched, target)
        patched._otel_patch = True  # type: ignore[attr-defined]
        setattr(owner, name, patched)
        return self.add(Patch(owner, name, original))

    def remove(self, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Remove every handle, the last made first; one that fails does not stop the rest."""
        while self._items:
            handle = self._items.pop()
            try:
                handle.remove()
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(exc)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Handle]:
        return iter(list(self._items))


def _target(owner: Any, name: str) -> tuple:
    """(what ``owner.__dict__`` holds, what to wrap); the latter _MISSING when absent,
    already ours, or a static/class method."""
    original = vars(owner).get(name, _MISSING)
    target = getattr(owner, name, _MISSING)
    if isinstance(target, wrapt.ObjectProxy) or getattr(target, "_otel_patch", False):
        return original, _MISSING
    if original is not _MISSING and isinstance(original, (staticmethod, classmethod)):
        return original, _MISSING
    return original, target
