"""Device timers: how phase boundaries are timed on the accelerator.

The training thread calls ``mark()`` at every phase boundary; it must be cheap and
never block (except in ``sync`` mode, whose whole point is to block). The
pipeline thread later calls ``resolve(marks, tokens)`` to learn, for each boundary,
when the device finished the work issued before it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence


class DeviceTimer:
    """Host clocks only (mode ``off``): the device is not observed."""

    mode = "off"
    observes_device = False

    def mark(self) -> Any:
        return None

    def resolve(self, marks: Sequence[int], tokens: Sequence[Any]) -> Optional[List[int]]:
        """Device completion time of each mark (host perf_counter ns), or None."""
        return None

    def release(self, tokens: Sequence[Any]) -> None:
        """Give tokens back (e.g. to an event pool) when a step is dropped."""

    def close(self) -> None:
        pass


def make_timer(mode: str) -> DeviceTimer:
    """The timer for an ``OTEL_TRAINING_GPU_TIMING`` value (``auto`` resolved here)."""
    return DeviceTimer()
