"""Host gauges: real psutil end to end, plus controlled counters for the arithmetic."""

import logging
import time
from collections import namedtuple

import psutil
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_training.config import Config
from tests.conftest import reader_points
from otel_training.hardware import host as host_module
from otel_training.hardware import start_hardware_metrics

HOST_GAUGES = {
    "system.cpu.utilization": "1",
    "system.linux.memory.available": "By",
    "system.network.throughput": "By/s",
    "system.disk.operation_rate": "{operation}/s",
    "system.disk.throughput": "By/s",
}


points = reader_points


def units(reader):
    data = reader.get_metrics_data()
    return {m.name: m.unit for rm in data.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics}


@pytest.fixture
def hw(tmp_path):
    """Hardware metrics driven by hand (no thread), NVML off, a private host lock."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    handle = start_hardware_metrics(provider, Config(hardware_interval=1.0), host_name="node-7",
                                    lock_path=str(tmp_path / "hw.lock"), start=False, gpu=False)
    yield handle, reader
    handle.shutdown()
    provider.shutdown()


def test_all_host_gauges_present_with_host_name_and_units(hw):
    handle, reader = hw
    handle.collect_once()
    time.sleep(0.05)  # /proc/stat counts in 10 ms ticks
    handle.collect_once()
    got = points(reader)
    if psutil.disk_io_counters() is None:  # a container without disk counters
        pytest.skip("this machine reports no disk counters")
    for name in HOST_GAUGES:
        assert name in got, name
        for attrs, value in got[name]:
            assert attrs["host.name"] == "node-7"
            assert value >= 0
    assert units(reader).items() >= HOST_GAUGES.items()
    assert {a["network.io.direction"] for a, _ in got["system.network.throughput"]} == {
        "transmit", "receive"}
    assert {a["disk.io.direction"] for a, _ in got["system.disk.throughput"]} == {"read", "write"}
    assert {a["disk.io.direction"] for a, _ in got["system.disk.operation_rate"]} == {
        "read", "write"}
    [(_, cpu)] = got["system.cpu.utilization"]
    assert 0.0 <= cpu <= 1.0
    [(_, available)] = got["system.linux.memory.available"]
    assert 0 < available <= psutil.virtual_memory().total
    assert handle.is_host_sampler


def test_no_rates_before_the_second_sample(hw):
    handle, reader = hw
    handle.collect_once()
    got = points(reader)
    assert "system.linux.memory.available" in got  # an instant value needs one sample
    assert "system.network.throughput" not in got  # a rate needs two
    assert "system.cpu.utilization" not in got


NetIO = namedtuple("NetIO", "bytes_sent bytes_recv")
DiskIO = namedtuple("DiskIO", "read_count write_count read_bytes write_bytes")
CpuTimes = namedtuple("CpuTimes", "user nice system idle iowait irq softirq steal guest guest_nice")


class Counters:
    """Controlled psutil counters, advanced by the test."""

    def __init__(self):
        self.net = {"lo": NetIO(10**9, 10**9), "eth0": NetIO(0, 0)}
        self.disk = DiskIO(0, 0, 0, 0)
        self.cpu = CpuTimes(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        self.available = 1000

    def install(self, monkeypatch):
        monkeypatch.setattr(host_module, "PROC_ROOT", None)  # these are psutil's counters
        psutil_ = host_module.psutil
        monkeypatch.setattr(psutil_, "net_io_counters", lambda pernic=False, nowrap=True: dict(
            self.net))
        # a whole disk and its partition (same counts): only the disk is summed
        monkeypatch.setattr(psutil_, "disk_io_counters", lambda perdisk=False, nowrap=True: (
            {"sda": self.disk, "sda1": self.disk} if perdisk else self.disk))
        monkeypatch.setattr(host_module, "_is_whole_disk", lambda name: name == "sda")
        monkeypatch.setattr(psutil_, "cpu_times", lambda percpu=False: self.cpu)
        monkeypatch.setattr(psutil_, "virtual_memory",
                            lambda: namedtuple("VM", "available")(self.available))


def test_rates_are_counter_deltas_over_elapsed_time(hw, monkeypatch):
    handle, reader = hw
    sampler = handle._sampler
    c = Counters()
    c.install(monkeypatch)
    sampler.tick(now=100.0)
    # 2 s later: eth0 sent 4000 B and received 1000 B; loopback traffic is ignored
    c.net = {"lo": NetIO(2 * 10**9, 2 * 10**9), "eth0": NetIO(4000, 1000)}
    c.disk = DiskIO(10, 30, 4096, 8192)
    sampler.tick(now=102.0)
    # then 0.5 s later: 1000 B more sent
    c.net = {"lo": NetIO(2 * 10**9, 2 * 10**9), "eth0": NetIO(5000, 1000)}
    sampler.tick(now=102.5)
    got = points(reader)
    net = {a["network.io.direction"]: v for a, v in got["system.network.throughput"]}
    # over the whole interval: (4000 + 1000) B in 2.5 s, not the mean of 2000 and 2000
    assert net == pytest.approx({"transmit": 5000 / 2.5, "receive": 1000 / 2.5})
    ops = {a["disk.io.direction"]: v for a, v in got["system.disk.operation_rate"]}
    assert ops == pytest.approx({"read": 10 / 2.5, "write": 30 / 2.5})
    tput = {a["disk.io.direction"]: v for a, v in got["system.disk.throughput"]}
    assert tput == pytest.approx({"read": 4096 / 2.5, "write": 8192 / 2.5})


def test_cpu_utilization_is_busy_share_over_the_interval(hw, monkeypatch):
    handle, reader = hw
    sampler = handle._sampler
    c = Counters()
    c.install(monkeypatch)
    sampler.tick(now=0.0)
    # 2 cores, 1 s: 1.5 core-seconds busy (user+system), 0.5 idle -> 75 %
    c.cpu = CpuTimes(1.0, 0, 0.5, 0.3, 0.2, 0, 0, 0, 0, 0)
    sampler.tick(now=1.0)
    # next second fully idle -> interval average (1.5 busy of 4) = 37.5 %
    c.cpu = CpuTimes(1.0, 0, 0.5, 2.3, 0.2, 0, 0, 0, 0, 0)
    sampler.tick(now=2.0)
    [(_, cpu)] = points(reader)["system.cpu.utilization"]
    assert cpu == pytest.approx(0.375)


def test_mean_over_interval_and_last_value_when_no_new_sample(hw, monkeypatch):
    handle, reader = hw
    sampler = handle._sampler
    c = Counters()
    c.install(monkeypatch)
    for t, available in enumerate((1000, 2000, 6000)):
        c.available = available
        sampler.tick(now=float(t))
    [(_, mean)] = points(reader)["system.linux.memory.available"]
    assert mean == pytest.approx(3000)
    # no tick since the previous collection: the last known sample, not zero, not absent
    [(_, again)] = points(reader)["system.linux.memory.available"]
    assert again == 6000
    net = points(reader)["system.network.throughput"]
    assert {v for _, v in net} == {0.0}  # last known rate (no traffic), still present


def test_counter_reset_is_skipped_not_negative(hw, monkeypatch):
    handle, reader = hw
    sampler = handle._sampler
    c = Counters()
    c.install(monkeypatch)
    c.net = {"eth0": NetIO(10_000, 10_000)}
    sampler.tick(now=0.0)
    c.net = {"eth0": NetIO(100, 100)}  # an interface went away: totals dropped
    sampler.tick(now=1.0)
    c.net = {"eth0": NetIO(1100, 2100)}
    sampler.tick(now=2.0)
    net = {a["network.io.direction"]: v for a, v in points(reader)["system.network.throughput"]}
    assert net == pytest.approx({"transmit": 1000.0, "receive": 2000.0})


@pytest.mark.parametrize("failure", ["none", "raises"])
def test_container_without_disk_counters(hw, monkeypatch, caplog, failure):
    handle, reader = hw

    def no_disk(perdisk=False, nowrap=True):
        if failure == "raises":
            raise FileNotFoundError("/proc/diskstats")
        return None

    monkeypatch.setattr(host_module, "PROC_ROOT", None)  # psutil's path (procfs: its own tests)
    monkeypatch.setattr(host_module.psutil, "disk_io_counters", no_disk)
    with caplog.at_level(logging.INFO, logger="otel_training.hardware"):
        for _ in range(3):
            handle.collect_once()
            time.sleep(0.03)  # /proc/stat counts in 10 ms ticks
    got = points(reader)
    assert "system.disk.throughput" not in got
    assert "system.disk.operation_rate" not in got
    assert "system.linux.memory.available" in got and "system.cpu.utilization" in got
    lines = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert lines[0].name == "otel_training.hardware"
    assert "disk" in lines[0].getMessage()


def test_machine_without_network_interfaces(hw, monkeypatch, caplog):
    handle, reader = hw
    monkeypatch.setattr(host_module, "PROC_ROOT", None)  # psutil's path (procfs: its own tests)
    monkeypatch.setattr(host_module.psutil, "net_io_counters",
                        lambda pernic=False, nowrap=True: {})
    with caplog.at_level(logging.INFO, logger="otel_training.hardware"):
        handle.collect_once()
        handle.collect_once()
    assert "system.network.throughput" not in points(reader)
    [line] = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert "network" in line


def test_hardware_off_registers_nothing(tmp_path):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    handle = start_hardware_metrics(provider, Config(hardware=False), host_name="h",
                                    lock_path=str(tmp_path / "l"))
    handle.collect_once()
    assert points(reader) == {}
    handle.shutdown()


def test_cpu_counters_going_backwards_are_clamped(hw, monkeypatch):
    handle, reader = hw
    sampler = handle._sampler
    c = Counters()
    c.install(monkeypatch)
    c.cpu = CpuTimes(1.0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    sampler.tick(now=0.0)
    # 1 s on 2 cores, idle, but user time stepped back a little (seen on VMs): busy < 0
    c.cpu = CpuTimes(0.99, 0, 0, 2.0, 0, 0, 0, 0, 0, 0)
    sampler.tick(now=1.0)
    assert points(reader)["system.cpu.utilization"][0][1] == 0.0  # present, clamped to 0


@pytest.mark.slow
def test_a_run_shorter_than_the_export_interval_still_exports_its_hardware_samples():
    """The last export, at exit, carries the hardware samples taken since the one before:
    a run that ends before its first periodic export (here: one export, at exit) still
    reports its host's CPU and memory."""
    from tests.loops._run import cleanup, run_loop

    r = run_loop("nanogpt_accum", extra_env={"OTEL_TRAINING_HARDWARE": "true"})
    cleanup()
    assert r.error is None and r.returncode == 0, r.stderr_tail()
    for name in ("system.cpu.utilization", "system.linux.memory.available"):
        assert r.gauges.get(name), f"no {name} exported at exit: {sorted(r.gauges)}"
    [(attrs, available)] = r.gauges["system.linux.memory.available"]
    assert attrs["host.name"] and 0 < available <= psutil.virtual_memory().total
