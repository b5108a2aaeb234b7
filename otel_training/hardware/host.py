"""Host samples through psutil: CPU, available memory, network and disk counters.

Counters become rates from deltas over the elapsed (monotonic) time between two
ticks. A source the machine lacks (a container without /proc/diskstats, no network
interface) is dropped after one log line; its gauges are then absent.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Dict, Optional, Tuple

import psutil

from otel_training.hardware import names as n
from otel_training.hardware.stats import Store, attributes

_logger = logging.getLogger("otel_training.hardware")

_LINUX = sys.platform.startswith("linux")
_LOOPBACK = ("lo", "lo0")


def _cpu() -> Tuple[float, float]:
    """(busy, total) CPU seconds summed over cores, counted as psutil.cpu_percent does."""
    t = psutil.cpu_times()
    total = sum(t)
    if _LINUX:
        # guest time is already included in user/nice
        total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total


def _network() -> Optional[Tuple[float, float]]:
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
        self._whole: Dict[str, bool] = {}

    def __call__(self) -> Optional[Tuple[float, float, float, float]]:
        if not _LINUX:
            c = psutil.disk_io_counters(perdisk=False, nowrap=False)
            return None if c is None else (c.read_count, c.write_count, c.read_bytes,
                                           c.write_bytes)
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


class HostSource:
    """Samples the host once per tick into a Store (only the per-host lock holder does)."""

    def __init__(self, store: Store, host_name: str) -> None:
        self._store = store
        self._attrs = attributes(**{n.HOST_NAME: host_name})
        a = {n.HOST_NAME: host_name}
        self._net_attrs = (attributes(**a, **{n.NETWORK_DIRECTION: "transmit"}),
                           attributes(**a, **{n.NETWORK_DIRECTION: "receive"}))
        self._disk_attrs = (attributes(**a, **{n.DISK_DIRECTION: "read"}),
                            attributes(**a, **{n.DISK_DIRECTION: "write"}))
        # source name -> reader; a source is removed for good when unavailable
        self._readers: Dict[str, Callable] = {
            "cpu": _cpu, "memory": self._memory, "network": _network, "disk": _Disks()}
        self._gauges = {"cpu": (n.CPU_UTILIZATION,), "memory": (n.MEMORY_AVAILABLE,),
                        "network": (n.NETWORK_THROUGHPUT,),
                        "disk": (n.DISK_OPERATION_RATE, n.DISK_THROUGHPUT)}
        self._previous: Dict[str, Tuple[float, tuple]] = {}

    def reset(self) -> None:
        """Forget counter baselines (after another process sampled for a while)."""
        self._previous.clear()

    def sample(self, now: float) -> None:
        for source, read in list(self._readers.items()):
            try:
                value = read()
            except Exception as exc:  # psutil raises on missing /proc files
                self._disable(source, f"{type(exc).__name__}: {exc}")
                continue
            if value is None:
                self._disable(source, "not reported on this machine")
                continue
            self._record(source, now, value)

    def _memory(self) -> float:
        return psutil.virtual_memory().available

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
        deltas = [new - prev for new, prev in zip(value, old)]
        if source == "network":
            for attrs, delta in zip(self._net_attrs, deltas):
                store.add_ratio(n.NETWORK_THROUGHPUT, attrs, delta, elapsed)
        else:
            for attrs, delta in zip(self._disk_attrs, deltas[:2]):
                store.add_ratio(n.DISK_OPERATION_RATE, attrs, delta, elapsed)
            for attrs, delta in zip(self._disk_attrs, deltas[2:]):
                store.add_ratio(n.DISK_THROUGHPUT, attrs, delta, elapsed)

    def _disable(self, source: str, why: str) -> None:
        del self._readers[source]
        self._previous.pop(source, None)
        for gauge in self._gauges[source]:
            self._store.drop(gauge)
        _logger.info("host %s metrics unavailable (%s): %s absent", source, why,
                     ", ".join(self._gauges[source]))
