"""Loaders that are not torch DataLoaders, timed as one: Grain.

torchtitan feeds its trainer from a Grain pipeline (``GrainDataLoader``: an
``IterDataset`` batched, collated and prefetched on a thread), and Grain is JAX's
loader too. No torch hook sees its ``next()``: the wait for a batch was the previous
step's untracked time, with no ``dataloader_next`` phase, no samples or tokens, and
the verdict blind to a data-bound run.

Every iterator a user makes of a Grain pipeline comes from one place: Grain injects an
``_OutputIterDataset`` at the end of each pipeline and iterates through it (the legacy
``grain.python.DataLoader`` too, on the caller's thread). Made on the training thread, the
iterator is handed back behind a transparent proxy whose ``next()`` the tracker times
exactly as a DataLoader iterator's ``__next__`` (docs/steps.md); Grain's own state,
checkpoint and ``close()`` methods pass through. Iterators made elsewhere (Grain's
prefetch threads and worker processes) are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import wrapt

from otel_training import semconv as sc
from otel_training.handles import Handles
from otel_training.record.events import TrainingEvents
from otel_training.record.import_hooks import ModuleHooks

# module -> (class, method) pairs whose call makes the iterator a user's loop reads
# (the legacy ``grain.python.DataLoader`` iterates a pipeline of its own through the same)
KNOWN: dict[str, tuple[tuple[str, str], ...]] = {
    "grain._src.python.dataset.dataset": (("_OutputIterDataset", "__iter__"),),
}
_HOOKS = ModuleHooks(KNOWN, "dataloader")


class ForeignLoaders:
    """Times the iterators of non-torch loaders on the training thread."""

    def __init__(self, events: TrainingEvents, on_error: Callable[[str, BaseException], None]) -> None:
        self._events = events
        self._on_error = on_error
        self._patches = Handles()
        self._patched: set[str] = set()

    def install(self) -> ForeignLoaders:
        _HOOKS.install(self, self.patch, self._on_error)
        return self

    def remove(self) -> None:
        _HOOKS.remove(self)
        self._patches.remove()
        self._patched.clear()

    def patch(self, module: Any) -> None:
        if module.__name__ in self._patched:
            return
        self._patched.add(module.__name__)
        for cls_name, method in KNOWN.get(module.__name__, ()):
            cls = getattr(module, cls_name, None)
            if isinstance(cls, type) and method in cls.__dict__:
                self._patches.wrap(cls, method, self._iter)

    # -- the user's iterator --------------------------------------------------------------
    def _iter(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        events = self._events
        started = None
        try:
            if events.on_training_thread():
                started = events.loader_iter_begin("grain")
        except Exception as exc:  # our bug: never the user's problem
            self._on_error("dataloader", exc)
        it = wrapped(*args, **kwargs)
        if started is None or isinstance(it, TimedIterator):
            return it
        try:
            return TimedIterator(it, self, started + (events.now(),))
        except Exception as exc:
            self._on_error("dataloader", exc)
            return it

    def next(self, proxy: TimedIterator) -> Any:
        """``next(proxy)``: the wrapped iterator's next batch, timed as a DataLoader's."""
        events = self._events
        recording = False
        try:
            if events.on_training_thread():
                started, proxy._self_started = proxy._self_started, None
                recording = events.loader_next_begin(proxy, started)
        except Exception as exc:
            self._on_error("dataloader", exc)
        if not recording:
            return next(proxy.__wrapped__)
        try:
            batch = next(proxy.__wrapped__)
        except StopIteration:
            try:
                events.loader_stopped(False)
            except Exception as exc:
                self._on_error("dataloader", exc)
            raise
        except BaseException as exc:
            try:
                events.record_error(exc)
                events.end_phase(sc.PHASE_DATALOADER_NEXT)
            except Exception as exc2:
                self._on_error("dataloader", exc2)
            raise
        try:
            events.loader_next_end(batch)
        except Exception as exc:
            self._on_error("dataloader", exc)
        return batch


class TimedIterator(wrapt.ObjectProxy):
    """A loader's iterator as the user's loop holds it: everything passes through to
    the iterator but ``next()``, which the tracker times."""

    def __init__(self, wrapped: Any, loaders: ForeignLoaders, started: tuple | None) -> None:
        super().__init__(wrapped)
        self._self_loaders = loaders
        self._self_started = started

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self) -> Any:
        return self._self_loaders.next(self)
