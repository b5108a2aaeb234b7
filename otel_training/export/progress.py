"""How long the training thread has been inside its current phase: the sign of a hang.

``training.phase.open.duration`` (docs/telemetry.md) is an observable gauge, read at
each metric export: the seconds since the innermost phase still open on the training
thread began (a DataLoader wait, a backward with its gradient all-reduce, a collective,
an optimizer step, a ``.item()`` waiting for the device, a user phase), or 0 while the
thread is in no phase (between phases, in untracked code, after training ended).

A hung process shows it growing without bound; a process that finished training and
stays alive (a notebook, a final upload) shows 0. The ``TrainingStalled`` alert uses
it. The tracker is read without locking from the reader's thread: its fields may
change underneath, so a read that does not add up reports 0 for that export.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from otel_training import semconv as sc

if TYPE_CHECKING:
    from otel_training.record.tracker import Tracker


def open_phase_seconds(tracker: Tracker) -> float:
    """Seconds the innermost open phase has lasted (0 without one). The
    ``train_batch``/``eval_batch`` container, which stays open between an update and
    the next step, does not count: only the phases the thread is really in."""
    started = tracker.open_phase_start()
    return 0.0 if started is None else max(0.0, (tracker.now() - started) / 1e9)


class _Observed:
    """What the gauge of one meter reads: the tracker registered last (held weakly)."""

    def __init__(self) -> None:
        self.tracker: weakref.ref | None = None
        self.attributes: dict = {}
        self.on_error: Callable[[str, BaseException], None] | None = None

    def callback(self, options) -> Iterable:
        from opentelemetry.metrics import Observation

        tracker = self.tracker() if self.tracker is not None else None
        try:
            if tracker is None or (tracker.step is None and not tracker.assembler.steps):
                return []  # no training here (yet): a torchrun launcher, a process that never steps
            return [Observation(open_phase_seconds(tracker), self.attributes)]
        except Exception as exc:  # our bug: counted, and no point this export
            if self.on_error is not None:
                self.on_error("progress", exc)
            return []


_OBSERVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # meter -> _Observed


def register(
    meter: Any,
    tracker: Tracker,
    attributes: dict | None = None,
    on_error: Callable[[str, BaseException], None] | None = None,
) -> None:
    """Export ``training.phase.open.duration`` for ``tracker`` on ``meter`` (with the
    common attributes: host, rank). The SDK keeps the first callback registered under a
    name on a meter, so the instrument is created once per meter and reads whichever
    tracker registered last."""
    observed = _OBSERVED.get(meter)
    if observed is None:
        observed = _OBSERVED[meter] = _Observed()
        meter.create_observable_gauge(
            sc.METRIC_PHASE_OPEN_DURATION,
            callbacks=[observed.callback],
            unit="s",
            description="Seconds the training thread has been inside its current phase (0 outside phases)",
        )
    observed.tracker = weakref.ref(tracker)
    observed.attributes = dict(attributes or {})
    observed.on_error = on_error
