"""Device timers: how phase boundaries are timed on the accelerator.

The training thread calls ``mark()`` at every phase boundary and takes its host
timestamp right after; ``mark()`` must be cheap and never block (except in
``sync`` mode, whose whole point is to block). The pipeline thread later calls
``resolve(marks, tokens)`` to learn, for each boundary, when the device finished
the work issued before it, on the host ``perf_counter_ns`` scale.

Modes (``OTEL_TRAINING_GPU_TIMING``): ``events`` (CUDA events, see
``cuda_events.py``), ``sync`` (``torch.cuda.synchronize()`` at each boundary),
``off`` (host clocks), ``auto`` (``events`` once CUDA is in use, else ``off``).
torch is imported lazily: this module imports without it. docs/gpu-timing.md
has the design and the caveats.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, List, Optional, Sequence

logger = logging.getLogger("otel_training")

MODES = ("auto", "events", "sync", "off")


class DeviceTimes(list):
    """What ``resolve`` returns: per mark, when the device had finished the work
    issued before it (host perf_counter ns), or None where unknown.

    ``arrivals`` is when the training thread *reached* each boundary, before the
    timer's own blocking; None means the host marks themselves (only ``sync``
    mode differs). ``attribution.idle_between`` reads it.
    """

    __slots__ = ("arrivals",)

    def __init__(self, values: Sequence[Optional[int]], arrivals: Optional[Sequence[int]] = None):
        super().__init__(values)
        self.arrivals = arrivals


class DeviceTimer:
    """Host clocks only (mode ``off``): the device is not observed."""

    mode = "off"
    observes_device = False

    def mark(self) -> Any:
        """Called on the training thread at a boundary, just before its host timestamp."""
        return None

    def resolve(self, marks: Sequence[int], tokens: Sequence[Any]) -> Optional[List[Optional[int]]]:
        """Device completion time of each mark (host perf_counter ns), or None.

        Called on the pipeline thread, steps in the order they were recorded; may
        block (without holding the GIL) until the device reached the last mark."""
        return None

    def release(self, tokens: Sequence[Any]) -> None:
        """Give tokens back (e.g. to an event pool) when a step is dropped unresolved."""

    def close(self) -> None:
        pass


class SyncTimer(DeviceTimer):
    """Mode ``sync``: ``torch.cuda.synchronize()`` at every boundary.

    Exact (the host mark taken right after is when the device finished), but it
    stalls the host at every boundary: training slows down and the data loader
    gets slack it would not have otherwise. The token is the host time *before*
    the wait, so GPU idle attribution can tell "device still busy" from "device
    already idle" at each boundary.
    """

    mode = "sync"
    observes_device = True

    def __init__(self, backend: Any = None, clock=time.perf_counter_ns):
        self._backend = backend
        self._clock = clock
        self._active = False
        self._disabled = False

    def _activate(self) -> bool:
        if self._backend is None:
            from otel_training.cuda_events import torch_backend

            self._backend = torch_backend()
            if self._backend is None:
                return False
            if self._backend is False:
                self._disable("CUDA is not available")
                return False
        if not self._backend.ready():
            return False  # CUDA not initialized yet: nothing to synchronize
        self._active = True
        return True

    def _disable(self, why: str) -> None:
        self._disabled = True
        logger.warning("otel-training: OTEL_TRAINING_GPU_TIMING=sync but %s; using host clocks", why)

    def mark(self) -> Any:
        arrived = self._clock()
        if not self._active and (self._disabled or not self._activate()):
            return None
        backend = self._backend
        try:
            if backend.capturing():  # synchronizing would break a CUDA graph capture
                return None
            backend.synchronize()
        except Exception as exc:  # a sticky CUDA error: stop touching the device
            self._active = False
            self._disable(f"synchronize failed ({exc!r})")
            return None
        return arrived

    def resolve(self, marks: Sequence[int], tokens: Sequence[Any]) -> Optional[List[Optional[int]]]:
        if all(t is None for t in tokens):
            return None
        # The mark was taken right after the device drained: device = host.
        device = [m if t is not None else None for m, t in zip(marks, tokens)]
        arrivals = [t if t is not None else m for m, t in zip(marks, tokens)]
        return DeviceTimes(device, arrivals)


def make_timer(mode: str, **options: Any) -> DeviceTimer:
    """The timer for an ``OTEL_TRAINING_GPU_TIMING`` value; never raises.

    ``auto``: ``off`` when torch is imported without usable CUDA; otherwise an
    events timer that stays inert (mode ``off``) until CUDA is initialized by the
    program -- we never initialize CUDA ourselves -- and then becomes ``events``.
    ``events``/``sync`` without usable CUDA fall back to ``off`` with one log line.
    ``options`` go to the timer (tests, benchmarks).
    """
    mode = (mode or "auto").strip().lower()
    if mode == "off":
        return DeviceTimer()
    if mode not in MODES:
        logger.warning("otel-training: unknown GPU timing mode %r; using host clocks", mode)
        return DeviceTimer()
    try:
        if options.get("backend") is None:
            torch = sys.modules.get("torch")
            if torch is None and mode != "auto":
                try:
                    import torch  # explicit events/sync: the program uses torch anyway
                except Exception as exc:
                    logger.warning("otel-training: OTEL_TRAINING_GPU_TIMING=%s but torch is unusable "
                                   "(%r); using host clocks", mode, exc)
                    return DeviceTimer()
            if torch is not None and not _cuda_available(torch):
                if mode != "auto":
                    logger.warning("otel-training: OTEL_TRAINING_GPU_TIMING=%s but CUDA is not available; "
                                   "using host clocks", mode)
                return DeviceTimer()
        if mode == "sync":
            return SyncTimer(**options)
        from otel_training.cuda_events import CudaEventTimer

        return CudaEventTimer(**options)
    except Exception as exc:  # never let timing break training
        logger.warning("otel-training: GPU timing %r unavailable (%r); using host clocks", mode, exc)
        return DeviceTimer()


def _cuda_available(torch: Any) -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False
