"""What the device timers need from torch.cuda (a simulated device stands in, in tests)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol


class CudaBackend(Protocol):
    """What the device timers need from torch.cuda: ``TorchCudaBackend``, or a
    simulated device in tests. Events and streams are torch's (or the simulation's)."""

    clock: Callable[[], int]  # host ns, the scale marks are taken on

    def ready(self) -> bool: ...
    def current_device(self) -> int: ...
    def new_event(self) -> Any: ...
    def new_stream(self, device: int) -> Any: ...
    def capturing(self) -> bool: ...
    def synchronize(self) -> None: ...


class TorchCudaBackend:
    """What the timers need from torch.cuda (a simulated device stands in, in tests)."""

    clock = staticmethod(time.perf_counter_ns)

    def __init__(self, torch: Any):
        cuda = torch.cuda
        self._cuda = cuda
        self.synchronize = cuda.synchronize
        # The C entry point skips a Python wrapper on the hot path.
        self.capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", cuda.is_current_stream_capturing)

    def ready(self) -> bool:
        """CUDA is initialized (the program uses it); we never initialize it ourselves."""
        return self._cuda.is_initialized()

    def current_device(self) -> int:
        return self._cuda.current_device()

    def new_event(self) -> Any:
        # blocking=True is cudaEventBlockingSync: synchronize() sleeps, no busy-wait.
        return self._cuda.Event(enable_timing=True, blocking=True)

    def new_stream(self, device: int) -> Any:
        # Pool streams are created cudaStreamNonBlocking: no implicit ordering with
        # the legacy default stream, so an anchor is not queued behind user work.
        return self._cuda.Stream(device=device)


def torch_backend() -> TorchCudaBackend | Literal[False] | None:
    """The torch.cuda backend; None while torch is not imported, False without CUDA."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return False
        return TorchCudaBackend(torch)
    except Exception:
        return False
