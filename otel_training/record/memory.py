"""Memory at step ends, read on the training thread (at most every ``EVERY_NS``).

On CUDA (once the process has initialized it), the caching allocator's statistics
of the current device: bytes allocated at the step's end, the peak allocated and
reserved since the previous reading (the peaks are reset after each read), and the
cumulative allocator retries and out-of-memory errors. Elsewhere, the process's
resident set size from ``/proc/self/statm`` through a file kept open (no psutil
call, no new file per read). Nothing here synchronizes with the device: allocator
statistics are host-side bookkeeping.

Why at the step's end, on the training thread: the memory a step keeps is what
is left once it ended (the step's own activations are freed by then), and a
reading taken at a random instant by another thread lands mid-step. Why at most
every ``EVERY_NS``: a read costs a few microseconds (docs/performance.md); at
millisecond steps one step in several is read, and the peaks then cover the steps
since the previous reading.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

EVERY_NS = 10_000_000  # the shortest time between two readings
KIND_CUDA = "cuda"
KIND_CPU = "cpu"


class MemoryReading(NamedTuple):
    """Memory at one step's end. ``current``: bytes the allocator holds for tensors
    (CUDA) or the process's RSS (CPU); the peaks, retries and OOMs are CUDA's."""

    kind: str
    device: str | None  # the GPU's UUID as NVML names it (``hw.id``), CUDA only
    current: int
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    alloc_retries: int | None = None  # cumulative, since the process started
    ooms: int | None = None


class MemoryReader:
    """Takes a ``MemoryReading`` when ``read`` is called (training thread)."""

    def __init__(self, every_ns: int = EVERY_NS) -> None:
        self.every_ns = every_ns
        self.due = 0  # host ns from which the next step end is read
        self._statm: int | None = None  # fd of /proc/self/statm, opened on first use
        self._page = 4096
        self._cpu_ok = True
        self._uuids: dict[int, str | None] = {}
        self._cuda: Any = None  # torch.cuda, once CUDA is initialized
        self.failed: BaseException | None = None  # the error that stopped reading

    def read(self, now: int) -> MemoryReading | None:
        self.due = now + self.every_ns
        try:
            cuda = self._cuda
            if cuda is None:
                torch = sys.modules.get("torch")
                if torch is not None and torch.cuda.is_initialized():
                    cuda = self._cuda = torch.cuda
            if cuda is not None:
                return self._read_cuda(cuda)
            return self._read_rss() if self._cpu_ok else None
        except Exception as exc:  # our bug or an odd platform: stop reading
            self.failed = exc
            self.due = 1 << 62
            return None

    def _read_cuda(self, cuda: Any) -> MemoryReading:
        device = cuda.current_device()
        c = sys.modules["torch"]._C
        stats_of = getattr(c, "_cuda_memoryStats", None)
        if stats_of is not None:  # the nested dict, built in C++: no flattening
            stats = stats_of(device)
            allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
            values = (allocated["current"], allocated["peak"], reserved["peak"])
            retries, ooms = stats.get("num_alloc_retries"), stats.get("num_ooms")
        else:  # pragma: no cover - a torch without the binding
            flat = cuda.memory_stats(device)
            values = (
                flat["allocated_bytes.all.current"],
                flat["allocated_bytes.all.peak"],
                flat["reserved_bytes.all.peak"],
            )
            retries, ooms = flat.get("num_alloc_retries"), flat.get("num_ooms")
        cuda.reset_peak_memory_stats(device)
        uuid = self._uuids.get(device, "")
        if uuid == "":
            uuid = self._uuids[device] = gpu_uuid(cuda, device)
        return MemoryReading(KIND_CUDA, uuid, int(values[0]), int(values[1]), int(values[2]), retries, ooms)

    def _read_rss(self) -> MemoryReading | None:
        fd = self._statm
        if fd is None:
            try:
                fd = self._statm = os.open("/proc/self/statm", os.O_RDONLY)
                self._page = os.sysconf("SC_PAGE_SIZE")
            except (OSError, AttributeError, ValueError):
                self._cpu_ok = False  # no procfs (macOS, Windows): no RSS readings
                return None
        # "size resident shared ...", in pages
        return MemoryReading(KIND_CPU, None, int(os.pread(fd, 128, 0).split()[1]) * self._page)

    def close(self) -> None:
        fd, self._statm = self._statm, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def gpu_uuid(cuda: Any, device: int) -> str | None:
    """``GPU-<uuid>``: the ``hw.id`` the hardware gauges carry for the same GPU."""
    try:
        uuid = str(cuda.get_device_properties(device).uuid)
    except Exception:
        return None
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
