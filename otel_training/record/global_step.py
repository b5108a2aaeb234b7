"""The framework's global step, where the framework tells one.

The HF ``Trainer`` and Lightning count optimizer steps across a resumed run
(``TrainerState.global_step``, ``Trainer.global_step``) and restore that count from a
checkpoint before training begins. Their integrations hand a reader of it here when
training begins; the value then is where this attempt resumed. Checkpoint saves are
tagged with the count at the save (record/activities.py), and the attempt's record
keeps the last one (runtime/attempts.py): steps a later attempt redoes are lost
progress. Nothing here runs per step.
"""

from __future__ import annotations

from collections.abc import Callable


class GlobalStep:
    """Set on the training thread when training begins; read on any thread."""

    def __init__(self) -> None:
        self._read: Callable[[], object] | None = None
        self.resumed_at: int | None = None  # the count when this process's training began
        self.last: int | None = None  # the last count read (kept once the framework is gone)

    def follow(self, read: Callable[[], object]) -> None:
        """Training begins (any resume done): ``read()`` tells the count from now on.
        The first call in a process sets where it resumed."""
        self._read = read
        if self.resumed_at is None:
            self.resumed_at = self.current()

    def stop(self) -> None:
        self._read = None

    def current(self) -> int | None:
        """The count now (the last one read once training is over), or None where no
        framework tells it."""
        read = self._read
        if read is None:
            return self.last
        try:
            value = read()
            if value is not None:
                self.last = int(value)  # type: ignore[call-overload]
        except Exception:  # a framework object gone or changed: the last count
            pass
        return self.last
