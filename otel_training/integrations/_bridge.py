"""What integrations need from the tracker: steps, named phases, error reporting.

Every call is guarded: a failure inside telemetry is counted by the runtime's
self-telemetry and never reaches the training loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from otel_training import semconv as sc
from otel_training.record.events import DRIVER_DATALOADER, DRIVER_NONE, TrainingEvents

CALLBACK_PREFIX = "callback."


def callback_phase(cls_name: str, hook: str) -> str:
    """The phase name for one callback hook: ``callback.<Class>.<hook>``."""
    return f"{CALLBACK_PREFIX}{cls_name}.{hook}"


class Bridge:
    """Thin, exception-safe access to the active Tracker for one framework driver."""

    def __init__(self, provider: Callable[[], Any], driver: str) -> None:
        self._provider = provider
        self.driver = driver

    def tracker(self) -> TrainingEvents | None:
        try:
            obj = self._provider()
        except Exception:
            return None
        if obj is None:
            return None
        return getattr(obj, "tracker", obj)

    def error(self, exc: BaseException, *, said: bool = False) -> None:
        try:
            obj = self._provider()
            on_error = getattr(obj, "on_error", None)
            if on_error is not None:
                on_error(f"integrations.{self.driver}", exc, said=said)
        except Exception:  # pragma: no cover - nothing left to report to
            pass

    def follow_global_step(self, read: Callable[[], object]) -> None:
        """Training begins (a resume restored the count already): ``read()`` tells the
        framework's global step (record/global_step.py)."""
        try:
            goodput = getattr(self._provider(), "goodput", None)
            if goodput is not None:
                goodput.global_step.follow(read)
        except Exception as exc:
            self.error(exc)

    def start_step(self) -> None:
        t = self.tracker()
        if t is not None:
            try:
                t.start_step(driver=self.driver)
            except Exception as exc:
                self.error(exc)

    def release(self) -> None:
        """Hand step boundaries back to the DataLoader and the forwards (no step is
        open): the framework's evaluation loop is cut like a plain one."""
        t = self.tracker()
        if t is not None and t.step is None:
            try:
                t.claim_driver(DRIVER_NONE)
            except Exception as exc:
                self.error(exc)

    def open_released_step(self) -> None:
        """Begin a step in a released loop if none is open (a batch whose fetch came
        before: a loader that fetched it ahead)."""
        t = self.tracker()
        if t is not None and t.step is None and t.driver in (DRIVER_NONE, DRIVER_DATALOADER):
            try:
                t.start_step(DRIVER_NONE)
            except Exception as exc:
                self.error(exc)

    def end_released_step(self) -> None:
        """End the step a released loop left open (its last batch)."""
        t = self.tracker()
        if t is not None and t.step is not None and t.driver in (DRIVER_NONE, DRIVER_DATALOADER):
            try:
                t.finish_step()
            except Exception as exc:
                self.error(exc)

    def finish_step(self, error: BaseException | None = None) -> None:
        t = self.tracker()
        if t is not None and t.step is not None and t.driver == self.driver:
            try:
                t.finish_step(error)
            except Exception as exc:
                self.error(exc)

    def discard_empty_step(self, require_forward: bool = False) -> None:
        """End the open step, or drop it if nothing ran in it (no forward and no phase
        but waiting; with ``require_forward``, no forward at all)."""
        t = self.tracker()
        step = t.step if t is not None else None
        if t is None or step is None or t.driver != self.driver:
            return
        try:
            if not step.saw_forward and (
                require_forward or all(p.name == sc.PHASE_DATALOADER_NEXT for p in step.phases)
            ):
                t.discard_step()
            else:
                t.finish_step()
        except Exception as exc:
            self.error(exc)

    def begin(self, name: str, auto: bool = False) -> bool:
        """Open phase ``name``; True when it was opened (then call ``end``)."""
        t = self.tracker()
        if t is None or t.step is None:
            return False
        try:
            if not t.on_training_thread():
                return False
            return bool(t.begin_phase(name, auto=auto) if auto else t.begin_phase(name))
        except Exception as exc:
            self.error(exc)
            return False

    def end(self, name: str) -> None:
        t = self.tracker()
        if t is not None:
            try:
                t.end_phase(name)
            except Exception as exc:
                self.error(exc)

    def is_open(self, name: str) -> bool:
        t = self.tracker()
        step = getattr(t, "step", None)
        if step is None:
            return False
        return any(p.name == name and p.end < 0 for p in step.phases)

    def timed(self, name: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` inside phase ``name`` (when a step is open)."""
        opened = self.begin(name)
        try:
            return fn(*args, **kwargs)
        finally:
            if opened:
                self.end(name)
