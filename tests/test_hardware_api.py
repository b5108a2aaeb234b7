"""start_hardware_metrics: quick, never raising, a daemon thread, bounded shutdown."""

import logging
import threading
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_training.config import Config
from otel_training.hardware import HardwareMetrics, start_hardware_metrics
from otel_training.hardware.stats import Store
from tests.fake_pynvml import FakeGpu, fake_nvml  # noqa: F401 (fixture)


def names(reader):
    data = reader.get_metrics_data()
    return {m.name for rm in (data.resource_metrics if data else []) for sm in rm.scope_metrics
            for m in sm.metrics if m.data.data_points}


def sampler_threads():
    return [t for t in threading.enumerate() if t.name == "otel-training-hardware"]


@pytest.fixture
def provider():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield provider, reader
    provider.shutdown()


def test_thread_samples_at_the_interval_and_stops(provider, tmp_path, fake_nvml):  # noqa: F811
    provider, reader = provider
    hw = start_hardware_metrics(provider, Config(hardware_interval=0.05), host_name="h",
                                lock_path=str(tmp_path / "l"))
    [thread] = sampler_threads()
    assert thread.daemon
    time.sleep(0.4)
    got = names(reader)
    assert {"system.cpu.utilization", "system.network.throughput", "hw.gpu.utilization",
            "hw.gpu.memory.usage"} <= got
    assert fake_nvml.calls("nvmlDeviceGetMemoryInfo") >= 4  # several ticks, not one
    hw.shutdown(timeout=1.0)
    assert not thread.is_alive()
    assert names(reader) == set()  # a stopped sampler reports nothing
    assert fake_nvml.calls("nvmlShutdown") == 1


def test_returns_quickly_and_shuts_down_in_bounded_time_when_nvml_hangs(
        provider, tmp_path, fake_nvml, monkeypatch):  # noqa: F811
    provider, reader = provider
    release = threading.Event()
    monkeypatch.setattr(fake_nvml, "nvmlInit", lambda: release.wait(5))  # a wedged driver
    t0 = time.monotonic()
    hw = start_hardware_metrics(provider, Config(hardware_interval=0.05), host_name="h",
                                lock_path=str(tmp_path / "l"))
    assert time.monotonic() - t0 < 0.2  # NVML is initialised on the sampler thread
    t0 = time.monotonic()
    hw.shutdown(timeout=0.2)
    assert time.monotonic() - t0 < 0.5
    release.set()
    assert names(reader) == set()


def test_never_raises(caplog):
    with caplog.at_level(logging.WARNING, logger="otel_training.hardware"):
        hw = start_hardware_metrics(object(), Config(), host_name="h")  # not a MeterProvider
    assert isinstance(hw, HardwareMetrics) and not hw.active
    hw.shutdown()
    hw.collect_once()
    assert any("setup failed" in r.getMessage() for r in caplog.records)


def test_started_again_on_the_same_provider_the_gauges_report_the_new_sampler(provider, tmp_path):
    """The SDK gives the same meter back and keeps a gauge's first callbacks: after a
    shutdown (uninstrument) and a start again, the new sampler's values go out."""
    provider, reader = provider
    for _ in range(2):
        hw = start_hardware_metrics(provider, Config(), host_name="h", lock_path=str(tmp_path / "l"),
                                    start=False, gpu=False)
        hw.collect_once()
        time.sleep(0.05)
        hw.collect_once()
        assert "system.cpu.utilization" in names(reader)
        hw.shutdown()
        assert names(reader) == set()


def test_a_failing_read_does_not_escape_the_callback(provider, tmp_path, monkeypatch, caplog):
    provider, reader = provider
    hw = start_hardware_metrics(provider, Config(), host_name="h", lock_path=str(tmp_path / "l"),
                                start=False, gpu=False)
    hw.collect_once()
    time.sleep(0.05)
    hw.collect_once()
    real_collect = Store.collect

    def broken(self, name):
        if name == "system.linux.memory.available":
            raise RuntimeError("boom")
        return real_collect(self, name)

    monkeypatch.setattr(Store, "collect", broken)
    with caplog.at_level(logging.WARNING, logger="otel_training.hardware"):
        got = names(reader)
        names(reader)
    assert "system.linux.memory.available" not in got
    assert "system.cpu.utilization" in got  # the other gauges still report
    assert sum("reading system.linux.memory.available failed" in r.getMessage()
               for r in caplog.records) == 1
    hw.shutdown()


def test_a_failing_tick_does_not_kill_the_thread(provider, tmp_path, monkeypatch, caplog):
    provider, reader = provider
    from otel_training.hardware.host import HostSource

    calls = []

    def flaky(self, now):
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("first tick fails")

    monkeypatch.setattr(HostSource, "sample", flaky)
    with caplog.at_level(logging.WARNING, logger="otel_training.hardware"):
        hw = start_hardware_metrics(provider, Config(hardware_interval=0.02), host_name="h",
                                    lock_path=str(tmp_path / "l"), gpu=False)
        time.sleep(0.2)
        hw.shutdown()
    assert len(calls) >= 3
    assert sum("sampling failed" in r.getMessage() for r in caplog.records) == 1
