"""Linux host counters read straight from /proc: the sampler's fast path.

psutil opens, reads line by line and closes each file on every call, then builds named
tuples we mostly discard; here each file is opened once and re-read from offset 0
with ``os.pread`` (one system call, no seek), parsed with a few bytes operations. The
readings are psutil's: the same fields, the same disks (whole disks: names under
/sys/block, as psutil and iostat test), 512-byte sectors. Every reader raises
(``OSError``, ``ValueError``, ``IndexError``) when its file is missing or not in the
expected format; host.py then reads that source through psutil instead.
"""

from __future__ import annotations

import os

_SECTOR = 512  # /proc/diskstats counts 512-byte sectors whatever the device's own size
_LOOPBACK = (b"lo", b"lo0")
_CHUNK = 65536
# A read of a /proc seq_file stops early only at the end of the file or when the next
# line would overflow the kernel's buffer (at least a 4096-byte page; a line here is a
# few hundred bytes): a read this short is the whole file, which saves a second system
# call that would return b"" (a regular file, as in tests, returns all of it anyway).
_WHOLE = 2048


class ProcFile:
    """One file kept open (opened on first use), re-read from its start."""

    __slots__ = ("path", "_fd")

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def _open(self) -> int:
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return self._fd

    def head(self, size: int) -> bytes:
        """The first ``size`` bytes (the kernel still formats the whole file)."""
        fd = self._fd if self._fd is not None else self._open()
        return os.pread(fd, size, 0)

    def read(self) -> bytes:
        fd = self._fd if self._fd is not None else self._open()
        data = os.pread(fd, _CHUNK, 0)
        if len(data) < _WHOLE:
            return data
        parts = [data]
        offset = len(data)
        while True:
            more = os.pread(fd, _CHUNK, offset)
            if not more:
                return b"".join(parts)
            parts.append(more)
            offset += len(more)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class ProcHost:
    """Readers of the host counters from a /proc tree, with the return values of
    host.py's psutil readers.

    ``proc_root`` and ``sys_root`` (default ``/proc``, ``/sys``) let tests point the
    readers at a directory of fake files; nothing is opened before the first read.
    """

    def __init__(self, proc_root: str = "/proc", sys_root: str = "/sys") -> None:
        self.stat = ProcFile(os.path.join(proc_root, "stat"))
        self.meminfo = ProcFile(os.path.join(proc_root, "meminfo"))
        self.net_dev = ProcFile(os.path.join(proc_root, "net", "dev"))
        self.diskstats = ProcFile(os.path.join(proc_root, "diskstats"))
        self._sys_block = os.path.join(sys_root, "block")
        self._whole: dict[bytes, bool] = {}  # device name -> whole disk (names are stable)
        self._hz = float(os.sysconf("SC_CLK_TCK"))

    def cpu(self) -> tuple[float, float]:
        """(busy, total) CPU seconds over all cores, as host._cpu counts them."""
        data = self.stat.head(512)
        v = data[: data.index(b"\n")].split()
        if v[0] != b"cpu":
            raise ValueError(f"{self.stat.path}: no aggregate cpu line")
        # user nice system idle iowait irq softirq steal; guest and guest_nice (9, 10)
        # are already counted in user and nice
        total = sum(map(int, v[1:9]))
        busy = total - int(v[4]) - int(v[5])
        hz = self._hz
        return busy / hz, total / hz

    def memory(self) -> int:
        """MemAvailable in bytes (psutil estimates it on kernels < 3.14: that is the
        fallback's job, here a missing line raises)."""
        data = self.meminfo.head(1024)  # MemAvailable is the third line
        i = data.index(b"MemAvailable:") + 13
        return int(data[i : data.index(b"\n", i)].split()[0]) * 1024

    def network(self) -> tuple[int, int] | None:
        """(bytes sent, bytes received) over every interface but loopback; None: none."""
        sent = recv = 0
        seen = False
        for line in self.net_dev.read().split(b"\n")[2:]:  # two header lines
            name, colon, fields = line.rpartition(b":")
            if not colon:
                continue
            seen = True
            if name.strip() in _LOOPBACK:
                continue
            f = fields.split()
            recv += int(f[0])
            sent += int(f[8])
        return (sent, recv) if seen else None

    def disk(self) -> tuple[int, int, int, int] | None:
        """(read ops, write ops, read bytes, write bytes) over whole disks; None: none."""
        reads = writes = rsect = wsect = 0
        seen = False
        whole = self._whole
        for line in self.diskstats.read().splitlines():
            f = line.split()
            n = len(f)
            if n == 14 or n >= 18:  # a disk (2.6+; 4.18 and 5.5 appended fields)
                r, w, rs, ws = f[3], f[7], f[5], f[9]
            elif n == 7:  # a partition on 2.6.x
                r, w, rs, ws = f[3], f[5], f[4], f[6]
            elif not n:
                continue
            else:  # 2.4's 15 fields, or unknown: psutil's parser decides
                raise ValueError(f"{self.diskstats.path}: unexpected line {line!r}")
            seen = True
            name = f[2]
            is_disk = whole.get(name)
            if is_disk is None:
                is_disk = whole[name] = self._is_whole_disk(name)
            if is_disk:
                reads += int(r)
                writes += int(w)
                rsect += int(rs)
                wsect += int(ws)
        return (reads, writes, rsect * _SECTOR, wsect * _SECTOR) if seen else None

    def _is_whole_disk(self, name: bytes) -> bool:
        # only disks (loop and virtual ones included) have a /sys/block entry
        return os.path.exists(os.path.join(self._sys_block, os.fsdecode(name).replace("/", "!")))

    def close(self) -> None:
        for f in (self.stat, self.meminfo, self.net_dev, self.diskstats):
            f.close()
