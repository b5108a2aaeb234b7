"""Loops of generator wrappers around a DataLoader: where they really end.

accelerate's ``DataLoaderShard`` and timm's ``PrefetchLoader`` iterate a DataLoader
from a generator ``__iter__``, one batch ahead: the DataLoader's ``StopIteration``
comes while the last batch is still to be handed out, and the user's loop ends when
the generator returns, which no DataLoader hook sees. Unwatched, the last batch's
step began at its first forward as if no DataLoader drove the loop (frozen encoders
in eval mode then split it into an eval step and a train step), and whatever ran
after the loop (a checkpoint, validation set-up) was that step's untracked time.

``LoopWrappers`` watches such a class's loops with a generator around theirs: known
classes from their import, any other from its second loop on (found when its
``__iter__`` calls ``DataLoader.__iter__``). In a watched loop the DataLoader's end
keeps the open piece (the last batch joins it, the DataLoader still driving), and the
generator's return ends it: what follows lies between steps (docs/steps.md, rule 5).
A plain pass-through generator ends right after its DataLoader: nothing changes there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

from otel_training.handles import Handles
from otel_training.record.events import TrainingEvents
from otel_training.record.import_hooks import ModuleHooks

# Wrappers known to iterate a DataLoader one batch ahead: watched from their first loop.
KNOWN: dict[str, tuple[str, ...]] = {
    "accelerate.data_loader": ("DataLoaderShard", "DataLoaderDispatcher", "SkipDataLoader"),
    "timm.data.loader": ("PrefetchLoader",),
}
_HOOKS = ModuleHooks(KNOWN, "dataloader")


class LoopWrappers:
    """Watches the loops of generator wrappers around DataLoaders (training thread)."""

    def __init__(self, events: TrainingEvents, on_error: Callable[[str, BaseException], None]) -> None:
        self._events = events
        self._on_error = on_error
        self._patches = Handles()
        self._classes: set[type] = set()
        self.frames: set[int] = set()  # id() of the frames of the watched loops running now

    def install(self) -> LoopWrappers:
        _HOOKS.install(self, self.watch_known, self._on_error)
        return self

    def remove(self) -> None:
        _HOOKS.remove(self)
        self._patches.remove()
        self._classes.clear()

    # -- which classes -----------------------------------------------------------------
    def watch_known(self, module: Any) -> None:
        for name in KNOWN.get(module.__name__, ()):
            cls = getattr(module, name, None)
            if isinstance(cls, type):
                self.watch(cls)

    def discover(self, frame: Any) -> None:
        """``DataLoader.__iter__`` was called from ``frame``: if that is a generator
        ``__iter__`` of another object, watch that class's loops from now on."""
        code = frame.f_code
        if code.co_name != "__iter__" or not code.co_flags & inspect.CO_GENERATOR:
            return
        owner = frame.f_locals.get("self")
        for cls in type(owner).__mro__:
            fn = cls.__dict__.get("__iter__")
            if fn is not None:
                if getattr(fn, "__code__", None) is code:
                    self.watch(cls)
                return

    def watch(self, cls: type) -> None:
        if cls in self._classes or not inspect.isgeneratorfunction(cls.__dict__.get("__iter__")):
            return
        self._classes.add(cls)
        self._patches.wrap(cls, "__iter__", self._iter)

    # -- the watched loop ------------------------------------------------------------------
    def _iter(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        loop = wrapped(*args, **kwargs)
        return self._watched(loop) if inspect.isgenerator(loop) else loop

    def _watched(self, loop: Any) -> Iterator[Any]:
        key = id(loop.gi_frame)
        self.frames.add(key)
        try:
            yield from loop
        finally:
            self.frames.discard(key)
        try:  # the loop ran to its end (not a break, nor an error)
            events = self._events
            if events.on_training_thread():
                events.loop_ended()
        except Exception as exc:  # our bug: never the user's problem
            self._on_error("dataloader", exc)
