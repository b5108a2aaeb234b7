"""Mode ``sync``: ``torch.cuda.synchronize()`` at every boundary (docs/gpu-timing.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from otel_training.timing.cuda_backend import CudaBackend, torch_backend
from otel_training.timing.device import DeviceTimer, DeviceTimes

logger = logging.getLogger("otel_training")


class SyncTimer(DeviceTimer):
    """Mode ``sync``: ``torch.cuda.synchronize()`` at every boundary.

    Exact (the host mark taken right after is when the device finished), but it
    stalls the host at every boundary: training slows down and the data loader
    gets slack it would not have otherwise. The token is the host time *before*
    the wait, so GPU idle attribution can tell "device still busy" from "device
    already idle" at each boundary.
    """

    @property
    def mode(self) -> str:
        return "sync"

    @property
    def observes_device(self) -> bool:
        return True

    def __init__(self, backend: CudaBackend | None = None, clock: Callable[[], int] = time.perf_counter_ns):
        self._backend = backend
        self._clock = clock
        self._active = False
        self._disabled = False

    def _activate(self) -> bool:
        backend = self._backend
        if backend is None:
            found = torch_backend()
            if found is None:
                return False
            if found is False:
                self._disable("CUDA is not available")
                return False
            backend = self._backend = found
        if not backend.ready():
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
        if backend is None:  # (set whenever active)
            return None
        try:
            if backend.capturing():  # synchronizing would break a CUDA graph capture
                return None
            backend.synchronize()
        except Exception as exc:  # a sticky CUDA error: stop touching the device
            self._active = False
            self._disable(f"synchronize failed ({exc!r})")
            return None
        return arrived

    def resolve(self, marks: Sequence[int], tokens: Sequence[Any]) -> list[int | None] | None:
        if all(t is None for t in tokens):
            return None
        # The mark was taken right after the device drained: device = host.
        device = [m if t is not None else None for m, t in zip(marks, tokens)]
        arrivals = [t if t is not None else m for m, t in zip(marks, tokens)]
        return DeviceTimes(device, arrivals)
