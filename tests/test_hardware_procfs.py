"""The Linux /proc fast path: psutil's readings, and psutil's code as the fallback."""

import logging
import os
import shutil
import sys
import time
from collections import namedtuple

import psutil
import pytest

from otel_training.hardware import host as host_module
from otel_training.hardware import names as n
from otel_training.hardware.host import HostSource
from otel_training.hardware.procfs import ProcHost
from otel_training.hardware.stats import Store

PROC_FILES = ("stat", "meminfo", "net/dev", "diskstats")
linux = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not all(os.access("/proc/" + f, os.R_OK) for f in PROC_FILES),
    reason="needs Linux with a readable /proc")

HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

STAT = """cpu  100 20 30 400 50 6 7 8 9 10
cpu0 50 10 15 200 25 3 3 4 4 5
intr 12345 0 1 2
"""
MEMINFO = """MemTotal:       16000000 kB
MemFree:         1000000 kB
MemAvailable:    8000000 kB
Buffers:          100000 kB
"""
NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 9000000 10 0 0 0 0 0 0 9000000 10 0 0 0 0 0 0
  eth0: 1000 10 0 0 0 0 0 0 2000 20 0 0 0 0 0 0
veth0123456789a:300 3 0 0 0 0 0 0 400 4 0 0 0 0 0 0
"""
# sda (5.5+: 20 fields) and its partition, sdb (14 fields) and a 2.6-style partition
# line (7 fields), a name with a slash (/sys/block/cciss!c0d0)
DISKSTATS = """   8       0 sda 100 5 2000 30 50 6 1000 40 0 70 70 0 0 0 0 10 2
   8       1 sda1 90 5 1800 30 45 6 900 40 0 60 70 0 0 0 0 0 0
   8      16 sdb 10 0 200 1 5 0 100 2 0 3 3
   8      17 sdb1 9 180 4 80
 104       0 cciss/c0d0 1 0 8 0 2 0 16 0 0 0 0
"""
WHOLE_DISKS = ("sda", "sdb", "cciss!c0d0")


def fake_tree(root, files=PROC_FILES, **overrides):
    """A /proc and /sys pair under ``root``: ``(proc_root, sys_root)``."""
    content = {"stat": STAT, "meminfo": MEMINFO, "net/dev": NET_DEV, "diskstats": DISKSTATS}
    content.update({k.replace("_", "/"): v for k, v in overrides.items()})
    proc, sys_ = root / "proc", root / "sys"
    (proc / "net").mkdir(parents=True)
    for name in files:
        (proc / name).write_text(content[name])
    for disk in WHOLE_DISKS:
        (sys_ / "block" / disk).mkdir(parents=True)
    return str(proc), str(sys_)


def test_readings_from_fake_files(tmp_path):
    proc = ProcHost(*fake_tree(tmp_path))
    # busy excludes idle (400) and iowait (50); guest (9, 10) is already in user/nice
    assert proc.cpu() == pytest.approx((171 / HZ, 621 / HZ))
    assert proc.memory() == 8_000_000 * 1024
    assert proc.network() == (2000 + 400, 1000 + 300)  # (sent, received), not loopback
    # whole disks only, 512-byte sectors
    assert proc.disk() == (100 + 10 + 1, 50 + 5 + 2, (2000 + 200 + 8) * 512,
                           (1000 + 100 + 16) * 512)
    proc.close()


def test_files_stay_open_and_are_reread(tmp_path):
    proc_root, sys_root = fake_tree(tmp_path)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    proc = ProcHost(proc_root, sys_root)
    for _ in range(3):
        proc.cpu(), proc.memory(), proc.network(), proc.disk()
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds + 4  # one each, not one per read
    # rewritten in place (same inode, as the kernel's files): the next read sees it
    with open(os.path.join(proc_root, "meminfo"), "r+") as f:
        f.write(MEMINFO.replace("8000000", "7000000"))
    assert proc.memory() == 7_000_000 * 1024
    proc.close()
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds


def test_a_file_longer_than_one_read(tmp_path):
    many = "".join(f" 7 {i} loop{i} 1 0 2 0 3 0 4 0 0 0 0 0 0 0 0 0 0\n" for i in range(5000))
    proc_root, sys_root = fake_tree(tmp_path, diskstats=many)
    for i in range(5000):
        os.mkdir(os.path.join(sys_root, "block", f"loop{i}"))
    assert len(many) > 65536
    assert ProcHost(proc_root, sys_root).disk() == (5000, 15000, 5000 * 2 * 512,
                                                    5000 * 4 * 512)


@pytest.mark.parametrize("reader, name, content", [
    ("memory", "meminfo", "MemTotal: 1 kB\nMemFree: 1 kB\n"),  # before 3.14: no MemAvailable
    ("disk", "diskstats", "3 0 8 hda 8 8 8 8 8 8 8 8 8 8 8\n"),  # 2.4's layout
    ("cpu", "stat", "intr 1 2\n"),
    ("network", "net/dev", NET_DEV.replace("1000 10", "x 10")),
])
def test_unexpected_content_raises(tmp_path, reader, name, content):
    proc = ProcHost(*fake_tree(tmp_path, **{name.replace("/", "_"): content}))
    with pytest.raises((ValueError, IndexError)):
        getattr(proc, reader)()


def test_no_devices_is_none_not_zero(tmp_path):
    proc = ProcHost(*fake_tree(tmp_path, diskstats="", net_dev=NET_DEV.split("    lo")[0]))
    assert proc.disk() is None
    assert proc.network() is None


def test_same_readings_as_psutil_on_the_same_files(tmp_path, monkeypatch):
    """psutil parsing our fake tree, and a snapshot of this machine's /proc where there
    is one, gives exactly what the fast path gives."""
    trees = [fake_tree(tmp_path / "fake", files=("stat", "net/dev", "diskstats"))]
    if sys.platform.startswith("linux"):
        snap = tmp_path / "snapshot"
        (snap / "proc" / "net").mkdir(parents=True)
        for name in PROC_FILES:
            with open("/proc/" + name, "rb") as f:
                (snap / "proc" / name).write_bytes(f.read())
        trees.append((str(snap / "proc"), "/sys"))
    for proc_root, sys_root in trees:
        monkeypatch.setattr(psutil, "PROCFS_PATH", proc_root)
        monkeypatch.setattr(host_module, "_is_whole_disk", lambda name, s=sys_root: (
            os.path.exists(os.path.join(s, "block", name.replace("/", "!")))))
        proc = ProcHost(proc_root, sys_root)
        assert proc.cpu() == pytest.approx(host_module._cpu(), rel=1e-12)
        assert proc.network() == host_module._network()
        assert proc.disk() == host_module._Disks()()
        if os.path.exists(os.path.join(proc_root, "meminfo")):
            assert proc.memory() == host_module._memory()
        proc.close()


# -- this machine: the fast path against psutil reading the live /proc ------------------

@linux
def test_live_counters_match_psutil():
    """Each fast reading lies between two psutil readings taken just before and after."""
    proc = ProcHost()
    disks = host_module._Disks()
    for _ in range(3):
        before = host_module._network(), disks(), host_module._cpu()
        fast = proc.network(), proc.disk(), proc.cpu()
        after = host_module._network(), disks(), host_module._cpu()
        for b, f, a in zip(before[:2], fast[:2], after[:2]):
            assert all(x <= y <= z for x, y, z in zip(b, f, a)), (b, f, a)
        eps = 1e-6  # psutil sums floats
        assert all(x - eps <= y <= z + eps for x, y, z in zip(before[2], fast[2], after[2]))
    proc.close()


@linux
def test_live_memory_and_cpu_share_agree_with_psutil():
    proc = ProcHost()
    assert proc.memory() == pytest.approx(psutil.virtual_memory().available, rel=0.03)
    fast0, slow0 = proc.cpu(), host_module._cpu()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # some busy time on one core
        sum(range(1000))
    fast1, slow1 = proc.cpu(), host_module._cpu()
    share = lambda a, b: (b[0] - a[0]) / (b[1] - a[1])  # noqa: E731
    assert share(fast0, fast1) == pytest.approx(share(slow0, slow1), abs=0.05)
    assert 0.0 < share(fast0, fast1) <= 1.0 + 1e-9
    proc.close()


@linux
def test_live_counters_are_monotone():
    proc = ProcHost()
    readings = []
    for _ in range(5):
        readings.append((proc.network(), proc.disk(), proc.cpu()))
        time.sleep(0.01)
    for old, new in zip(readings, readings[1:]):
        for a, b in zip(old, new):
            assert all(x <= y for x, y in zip(a, b))
    proc.close()


# -- HostSource: per-source fallback to psutil ------------------------------------------

DiskIO = namedtuple("DiskIO", "read_count write_count read_bytes write_bytes")


def values(store):
    return {name: {dict(a).get(n.DISK_DIRECTION) or dict(a).get(n.NETWORK_DIRECTION): v
                   for a, v in store.collect(name)}
            for name in n.HOST_GAUGES}


def fallback_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "otel_training.hardware"]


def test_missing_file_falls_back_to_psutil_for_that_source_only(tmp_path, monkeypatch, caplog):
    proc_root, sys_root = fake_tree(tmp_path, files=("stat", "meminfo", "net/dev"))
    disk = [DiskIO(0, 0, 0, 0)]
    monkeypatch.setattr(host_module.psutil, "disk_io_counters",
                        lambda perdisk=False, nowrap=True: {"sda": disk[0]})
    monkeypatch.setattr(host_module, "_is_whole_disk", lambda name: name == "sda")
    store = Store()
    source = HostSource(store, "h", proc_root=proc_root, sys_root=sys_root)
    with caplog.at_level(logging.INFO, logger="otel_training.hardware"):
        source.sample(0.0)
        disk[0] = DiskIO(10, 20, 4096, 8192)
        source.sample(2.0)
        source.sample(3.0)
    got = values(store)
    assert got[n.MEMORY_AVAILABLE] == {None: 8_000_000 * 1024}  # from the fake meminfo
    assert got[n.DISK_OPERATION_RATE] == pytest.approx({"read": 10 / 3, "write": 20 / 3})
    assert got[n.DISK_THROUGHPUT] == pytest.approx({"read": 4096 / 3, "write": 8192 / 3})
    [line] = fallback_lines(caplog)
    assert "disk" in line and "psutil" in line and "diskstats" in line


def test_source_absent_when_psutil_fails_too(tmp_path, monkeypatch, caplog):
    proc_root, sys_root = fake_tree(tmp_path, files=("stat", "meminfo", "diskstats"))
    monkeypatch.setattr(host_module.psutil, "net_io_counters",
                        lambda pernic=False, nowrap=True: {})
    store = Store()
    source = HostSource(store, "h", proc_root=proc_root, sys_root=sys_root)
    with caplog.at_level(logging.INFO, logger="otel_training.hardware"):
        for t in range(3):
            source.sample(float(t))
    got = values(store)
    assert got[n.NETWORK_THROUGHPUT] == {}  # absent, not zero
    assert got[n.DISK_THROUGHPUT] == {"read": 0.0, "write": 0.0}  # a real zero (fake counters)
    [line] = fallback_lines(caplog)
    assert "network unavailable" in line.replace("metrics ", "")
    assert "/proc: FileNotFoundError" in line and "psutil: " in line


def test_a_failing_read_midway_falls_back_with_a_new_baseline(tmp_path, monkeypatch, caplog):
    proc_root, sys_root = fake_tree(tmp_path)
    NetIO = namedtuple("NetIO", "bytes_sent bytes_recv")
    monkeypatch.setattr(host_module.psutil, "net_io_counters",
                        lambda pernic=False, nowrap=True: {"eth0": NetIO(10**6, 10**6)})
    store = Store()
    source = HostSource(store, "h", proc_root=proc_root, sys_root=sys_root)
    source.sample(0.0)
    with open(os.path.join(proc_root, "net", "dev"), "r+") as f:
        f.write(NET_DEV.replace("1000 10", "garbage 10"))
    with caplog.at_level(logging.INFO, logger="otel_training.hardware"):
        source.sample(1.0)  # psutil's reading: a new baseline, not a delta from /proc's
        source.sample(2.0)
    assert values(store)[n.NETWORK_THROUGHPUT] == {"transmit": 0.0, "receive": 0.0}
    [line] = fallback_lines(caplog)
    assert "network" in line and "psutil" in line


def test_no_files_opened_before_the_first_sample(tmp_path):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc/self/fd")
    proc_root, sys_root = fake_tree(tmp_path)
    fds = len(os.listdir("/proc/self/fd"))
    source = HostSource(Store(), "h", proc_root=proc_root, sys_root=sys_root)
    assert len(os.listdir("/proc/self/fd")) == fds  # a rank without the host lock
    source.sample(0.0)
    source.sample(1.0)
    assert len(os.listdir("/proc/self/fd")) == fds + 4
    source.close()
    assert len(os.listdir("/proc/self/fd")) == fds


def test_proc_root_none_reads_through_psutil(tmp_path, monkeypatch):
    proc_root, sys_root = fake_tree(tmp_path)
    monkeypatch.setattr(host_module.psutil, "virtual_memory",
                        lambda: namedtuple("VM", "available")(1234))
    store = Store()
    HostSource(store, "h", proc_root=None).sample(0.0)
    assert values(store)[n.MEMORY_AVAILABLE] == {None: 1234}
    store = Store()
    HostSource(store, "h", proc_root=proc_root, sys_root=sys_root).sample(0.0)
    assert values(store)[n.MEMORY_AVAILABLE] == {None: 8_000_000 * 1024}


def test_default_proc_root_is_linux_only():
    assert host_module.PROC_ROOT == ("/proc" if sys.platform.startswith("linux") else None)


@linux
def test_default_source_reads_this_machine(tmp_path):
    store = Store()
    source = HostSource(store, "h")
    source.sample(time.monotonic())
    time.sleep(0.05)
    source.sample(time.monotonic())
    got = values(store)
    assert 0.0 <= got[n.CPU_UTILIZATION][None] <= 1.0
    assert got[n.MEMORY_AVAILABLE][None] > 0
    assert set(got[n.NETWORK_THROUGHPUT]) == {"transmit", "receive"}
    if psutil.disk_io_counters() is not None:
        assert set(got[n.DISK_THROUGHPUT]) == {"read", "write"}
    source.close()
