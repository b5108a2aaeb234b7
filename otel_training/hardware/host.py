"""Host samples: CPU, available memory, network and disk counters.

On Linux each source is read from /proc directly (procfs.py, about 3x cheaper); psutil
is the portable source and the fallback, per source, when a /proc file is missing or
unreadable. Counters become rates from deltas over the elapsed (monotonic) time
between two ticks. A source the machine lacks (a container without /proc/diskstats,
no network interface) is dropped after one log line; its gauges are then absent.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import psutil

from otel_training.hardware import names as n
from otel_training.hardware.procfs import ProcHost
from otel_training.hardware.stats import Store, attributes

_logger = logging.getLogger("otel_training.hardware")

_LINUX = sys.platform.startswith("linux")
_LOOPBACK = ("lo", "lo0")

#: The /proc tree the fast path reads by default; None reads every source through psutil.
PROC_ROOT: str | None = "/proc" if _LINUX else None
_DEFAULT = object()


def _cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds summed over cores, counted as psutil.cpu_percent does."""
    t = psutil.cpu_times()
    total = sum(t)
    if _LINUX:
        # guest time is already included in user/nice
        total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total


def _network() -> tuple[float, float] | None:
    """(bytes sent, bytes received) over every interface but loopback."""
    per_nic = psutil.net_io_counters(pernic=True, nowrap=False)
    if not per_nic:
        return None
    sent = recv = 0
    for nic, c in per_nic.items():
        if nic not in _LOOPBACK:
            sent += c.bytes_sent
            recv += c.bytes_recv
    return sent, recv


def _is_whole_disk(name: str) -> bool:
    """A disk, not a partition: only disks have a /sys/block entry (as psutil and iostat test)."""
    return os.path.exists("/sys/block/" + name.replace("/", "!"))


class _Disks:
    """(read ops, write ops, read bytes, write bytes) summed over whole disks.

    psutil's own total (``perdisk=False``) tests every line of /proc/diskstats against
    /sys/block on each call; device names are stable, so we test each name once.
    """

    def __init__(self) -> None:
        self._whole: dict[str, bool] = {}

    def __call__(self) -> tuple[float, float, float, float] | None:
        if not _LINUX:
            c = psutil.disk_io_counters(perdisk=False, nowrap=False)
            return None if c is None else (c.read_count, c.write_count, c.read_bytes, c.write_bytes)
        per_disk = psutil.disk_io_counters(perdisk=True, nowrap=False)
        if not per_disk:
            return None
        reads = writes = rbytes = wbytes = 0
        whole = self._whole
        for name, c in per_disk.items():
            is_disk = whole.get(name)
            if is_disk is None:
                is_disk = whole[name] = _is_whole_disk(name)
            if is_disk:
                reads += c.read_count
                writes += c.write_count
                rbytes += c.read_bytes
                wbytes += c.write_bytes
        return reads, writes, rbytes, wbytes


def _memory() -> float:
    return psutil.virtual_memory().available


class HostSource:
    """Samples the host once per tick into a Store (only the per-host lock holder does).

    ``proc_root`` (default ``PROC_ROOT``: /proc on Linux) and ``sys_root`` are where the
    fast path reads; ``proc_root=None`` reads through psutil only. Files are opened at
    the first sample, so processes that never hold the host lock open nothing.
    """

    def __init__(self, store: Store, host_name: str, *, proc_root=_DEFAULT, sys_root: str = "/sys") -> None:
        self._store = store
        self._attrs = attributes(**{n.HOST_NAME: host_name})
        a = {n.HOST_NAME: host_name}
        self._net_attrs = (
            attributes(**a, **{n.NETWORK_DIRECTION: "transmit"}),
            attributes(**a, **{n.NETWORK_DIRECTION: "receive"}),
        )
        self._disk_attrs = (
            attributes(**a, **{n.DISK_DIRECTION: "read"}),
            attributes(**a, **{n.DISK_DIRECTION: "write"}),
        )
        self._roots = (proc_root, sys_root)
        self._psutil: dict[str, Callable] = {"cpu": _cpu, "memory": _memory, "network": _network, "disk": _Disks()}
        # source name -> reader, built at the first sample; a source is removed for
        # good when unavailable
        self._readers: dict[str, Callable[[], Any]] = {}  # filled at the first sample
        self._opened = False
        self._fast: set[str] = set()  # the sources read from /proc
        self._proc: ProcHost | None = None
        self._gauges = {
            "cpu": (n.CPU_UTILIZATION,),
            "memory": (n.MEMORY_AVAILABLE,),
            "network": (n.NETWORK_THROUGHPUT,),
            "disk": (n.DISK_OPERATION_RATE, n.DISK_THROUGHPUT),
        }
        self._previous: dict[str, tuple[float, tuple]] = {}

    def _open(self) -> dict[str, Callable]:
        proc_root, sys_root = self._roots
        if proc_root is _DEFAULT:
            proc_root = PROC_ROOT  # read now, so tests can pin psutil after construction
        if not proc_root:
            return dict(self._psutil)
        proc = self._proc = ProcHost(proc_root, sys_root)
        # the sampler never closes its sources: the descriptors go with this object
        weakref.finalize(self, proc.close).atexit = False
        self._fast = {"cpu", "memory", "network", "disk"}
        return {"cpu": proc.cpu, "memory": proc.memory, "network": proc.network, "disk": proc.disk}

    def close(self) -> None:
        """Close the /proc files (reopened by the next sample)."""
        if self._proc is not None:
            self._proc.close()

    def reset(self) -> None:
        """Forget counter baselines (after another process sampled for a while)."""
        self._previous.clear()

    def sample(self, now: float) -> None:
        readers = self._readers
        if not self._opened:
            readers = self._readers = self._open()
            self._opened = True
        for source, read in tuple(readers.items()):
            try:
                value = read()
            except Exception as exc:  # a missing file (psutil raises too), a bad format
                value = self._unavailable(source, f"{type(exc).__name__}: {exc}")
            else:
                if value is None:
                    value = self._unavailable(source, "not reported on this machine")
            if value is not None:
                self._record(source, now, value)

    def _unavailable(self, source: str, why: str):
        """Fall back from /proc to psutil (one log line), or drop the source (one log
        line); returns psutil's reading, or None."""
        if source in self._fast:
            self._fast.discard(source)
            self._previous.pop(source, None)  # a baseline from the other reader
            read = self._readers[source] = self._psutil[source]
            try:
                value = read()
            except Exception as exc:
                value, failed = None, f"{type(exc).__name__}: {exc}"
            else:
                failed = "not reported on this machine"
            if value is not None:
                _logger.info("host %s metrics read through psutil (/proc: %s)", source, why)
                return value
            why = f"/proc: {why}; psutil: {failed}"
        self._disable(source, why)
        return None

    def _record(self, source: str, now: float, value) -> None:
        store = self._store
        if source == "memory":
            store.add(n.MEMORY_AVAILABLE, self._attrs, value)
            return
        previous = self._previous.get(source)
        self._previous[source] = (now, value)
        if previous is None:
            return  # first reading is the baseline
        then, old = previous
        if source == "cpu":
            total = value[1] - old[1]
            # iowait may go backwards on Linux, so clamp busy as psutil.cpu_percent does
            busy = min(max(value[0] - old[0], 0.0), total)
            store.add_ratio(n.CPU_UTILIZATION, self._attrs, busy, total)
            return
        elapsed = now - then
        add = store.add_ratio
        if source == "network":
            transmit, receive = self._net_attrs
            add(n.NETWORK_THROUGHPUT, transmit, value[0] - old[0], elapsed)
            add(n.NETWORK_THROUGHPUT, receive, value[1] - old[1], elapsed)
        else:
            read, write = self._disk_attrs
            add(n.DISK_OPERATION_RATE, read, value[0] - old[0], elapsed)
            add(n.DISK_OPERATION_RATE, write, value[1] - old[1], elapsed)
            add(n.DISK_THROUGHPUT, read, value[2] - old[2], elapsed)
            add(n.DISK_THROUGHPUT, write, value[3] - old[3], elapsed)

    def _disable(self, source: str, why: str) -> None:
        del self._readers[source]
        self._previous.pop(source, None)
        for gauge in self._gauges[source]:
            self._store.drop(gauge)
        _logger.info("host %s metrics unavailable (%s): %s absent", source, why, ", ".join(self._gauges[source]))
