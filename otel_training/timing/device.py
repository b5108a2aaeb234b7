"""Device timers: how phase boundaries are timed on the accelerator.

The training thread calls ``mark()`` at every phase boundary and takes its host
timestamp right after; ``mark()`` must be cheap and never block (except in
``sync`` mode, whose whole point is to block). The pipeline thread later calls
``resolve(marks, tokens)`` to learn, for each boundary, when the device finished
the work issued before it, on the host ``perf_counter_ns`` scale.

Modes (``OTEL_TRAINING_GPU_TIMING``): ``events`` (CUDA events, ``cuda_events.py``),
``sync`` (``torch.cuda.synchronize()`` at each boundary, ``sync.py``), ``off``
(host clocks, this module), ``auto`` (``events`` once CUDA is in use, else ``off``).
docs/gpu-timing.md has the design and the caveats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MODES = ("auto", "events", "sync", "off")


class DeviceTimes(list):
    """What ``resolve`` returns: per mark, when the device had finished the work
    issued before it (host perf_counter ns), or None where unknown.

    ``arrivals`` is when the training thread *reached* each boundary, before the
    timer's own blocking; None means the host marks themselves (only ``sync``
    mode differs). ``attribution.idle_between`` reads it.
    """

    __slots__ = ("arrivals",)

    def __init__(self, values: Sequence[int | None], arrivals: Sequence[int] | None = None):
        super().__init__(values)
        self.arrivals = arrivals


class DeviceTimer:
    """Host clocks only (mode ``off``): the device is not observed."""

    @property
    def mode(self) -> str:
        """``off``, ``sync`` or ``events`` (``events`` once CUDA is in use)."""
        return "off"

    @property
    def observes_device(self) -> bool:
        """Whether ``resolve`` gives device times."""
        return False

    def mark(self) -> Any:
        """Called on the training thread at a boundary, just before its host timestamp."""
        return None

    def activate(self) -> bool:
        """Whether ``mark`` can give tokens now. A timer inert until the program
        initializes CUDA tries to start here (training thread); the tracker asks when
        each step (or piece) begins while ``observes_device`` is False, and marks host
        clocks alone meanwhile."""
        return True

    def resolve(self, marks: Sequence[int], tokens: Sequence[Any]) -> list[int | None] | None:
        """Device completion time of each mark (host perf_counter ns), or None.

        Called on the pipeline thread, steps in the order they were recorded; may
        block (without holding the GIL) until the device reached the last mark."""
        return None

    def release(self, tokens: Sequence[Any]) -> None:
        """Give tokens back (e.g. to an event pool) when a step is dropped unresolved."""

    def close(self) -> None:
        pass
