"""The manual API for custom loops: ``step()``, ``phase(name)`` and ``global_step(read)``.

``step`` and ``phase`` are context managers and decorators, cheap no-ops when
instrumentation is off, and usable together with auto-instrumentation (a manual
``step()`` takes over step boundaries; DataLoader waits inside it become
``dataloader_next``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

from otel_training.runtime import active as _runtime


class step(contextlib.ContextDecorator):
    """One training step: ``with otel_training.step(): ...``."""

    def __enter__(self):
        rt = _runtime.current()
        if rt is not None:
            try:
                rt.tracker.start_step("manual")
            except Exception as exc:
                rt.on_error("api", exc)
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        rt = _runtime.current()
        if rt is not None:
            try:
                rt.tracker.finish_step(exc)
            except Exception as err:
                rt.on_error("api", err)
        return False


class phase(contextlib.ContextDecorator):
    """A user-named phase: ``with otel_training.phase("augment"): ...``. Inside a step
    it is one of the step's phases; with no step open (a checkpoint between epochs,
    a save after the last step) it is named time between steps."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("otel_training.phase() needs a non-empty name")
        self.name = name
        self._opened = False
        self._between: Any = None  # with no step open: named time between steps (its record)

    def _recreate_cm(self):
        # As a decorator, each call gets its own instance: the open/closed state
        # must not be shared by recursive calls or calls from other threads.
        return type(self)(self.name)

    def __enter__(self):
        rt = _runtime.current()
        self._opened = False
        self._between = None
        if rt is not None:
            try:
                tracker = rt.tracker
                if tracker.on_training_thread():
                    self._opened = tracker.begin_phase(self.name)
                    if not self._opened:  # no step open: a checkpoint between epochs
                        self._between = tracker.begin_between(self.name)
            except Exception as exc:
                rt.on_error("api", exc)
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        if self._between is not None:
            rt = _runtime.current()
            if rt is not None:
                try:
                    rt.tracker.end_between(self._between, exc)
                except Exception as err:
                    rt.on_error("api", err)
            self._between = None
        if self._opened:
            rt = _runtime.current()
            if rt is not None:
                try:
                    if exc is not None:
                        rt.tracker.record_error(exc)
                    rt.tracker.end_phase(self.name)
                except Exception as err:
                    rt.on_error("api", err)
        return False


def global_step(read: Callable[[], int]) -> None:
    """Tell goodput your loop's global step, once, after any resume from a checkpoint:
    ``otel_training.global_step(lambda: iter_num)``. ``read()`` is called at checkpoint
    saves and every few seconds, never per step. A restarted run then counts the steps
    it does again after resuming as lost progress (the HF ``Trainer`` and Lightning tell
    theirs without this)."""
    if not callable(read):
        raise TypeError("otel_training.global_step() needs a callable returning the step, e.g. lambda: iter_num")
    rt = _runtime.current()
    if rt is not None:
        try:
            rt.goodput.global_step.follow(read)
        except Exception as exc:
            rt.on_error("api", exc)


def instrument(*, configure_sdk: bool | None = None, **kwargs) -> None:
    """Instrument this process from code (instead of ``opentelemetry-instrument``).

    When no OpenTelemetry SDK is configured yet (``configure_sdk`` None or True),
    set one up with the exporters named by the standard ``OTEL_*`` variables.
    """
    from opentelemetry import trace

    from otel_training.instrumentor import TrainingInstrumentor
    from otel_training.preflight import deliberately_off, torch_problem
    from otel_training.runtime.notice import not_instrumenting

    problem = None if deliberately_off() else torch_problem()
    if problem is not None:
        not_instrumenting(*problem)  # the one line, instead of the SDK's dependency-conflict record
        return
    if configure_sdk or (configure_sdk is None and type(trace.get_tracer_provider()).__name__.startswith("Proxy")):
        from otel_training.distro import configure_sdk as _configure

        _configure()
    TrainingInstrumentor().instrument(**kwargs)


def uninstrument() -> None:
    from otel_training.instrumentor import TrainingInstrumentor

    TrainingInstrumentor().uninstrument()
