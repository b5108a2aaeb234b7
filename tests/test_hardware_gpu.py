"""GPU gauges against the fake NVML (tests/fake_pynvml.py), read through a real SDK reader."""

import logging
import os

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from tests.fake_pynvml import FakeGpu, fake_nvml  # noqa: F401 (fixture)
from otel_training.config import Config
from tests.conftest import reader_points
from otel_training.hardware import start_hardware_metrics
from otel_training.hardware.agent_lock import HostLock

GPU_GAUGES = {
    "hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.free", "hw.gpu.memory.limit",
    "hw.gpu.memory.controller.utilization", "hw.gpu.clock.sm", "hw.gpu.power.draw",
    "hw.gpu.temperature", "hw.gpu.throttle", "hw.gpu.pcie.throughput",
}
PROCESS_GAUGES = {"process.gpu.memory.usage", "process.gpu.utilization"}


points = reader_points


def by_gpu(got, name, **match):
    """{gpu.index: value} of a metric's points whose attributes include ``match``."""
    return {a["gpu.index"]: v for a, v in got.get(name, [])
            if all(a.get(k) == w for k, w in match.items())}


@pytest.fixture
def hw(tmp_path, fake_nvml):  # noqa: F811
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    made = []

    def start(*gpus, init_error=None):
        fake_nvml.configure(list(gpus), init_error=init_error)
        handle = start_hardware_metrics(provider, Config(), host_name="node-3",
                                        lock_path=str(tmp_path / "hw.lock"), start=False)
        made.append(handle)
        return handle

    yield start, reader
    for handle in made:
        handle.shutdown()
    provider.shutdown()


def test_identity_attributes_and_units(hw):
    start, reader = hw
    gpus = [FakeGpu(0, name="NVIDIA A100-SXM4-80GB"), FakeGpu(1, name="NVIDIA A100-SXM4-80GB")]
    gpus[1].uuid = "GPU-1b2c3d4e-0000-1111-2222-333344445555"
    handle = start(*gpus)
    handle.collect_once()
    got = points(reader)
    assert GPU_GAUGES <= set(got)
    for name in GPU_GAUGES:
        indexes = set()
        for attrs, _ in got[name]:
            assert attrs["host.name"] == "node-3"
            assert attrs["hw.type"] == "gpu"
            assert attrs["hw.model"] == "NVIDIA A100-SXM4-80GB"
            assert attrs["hw.id"] == gpus[attrs["gpu.index"]].uuid
            indexes.add(attrs["gpu.index"])
        assert indexes == {0, 1}, name
    data = reader.get_metrics_data()
    units = {m.name: m.unit for rm in data.resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    assert units["hw.gpu.clock.sm"] == "Hz" and units["hw.gpu.power.draw"] == "W"
    assert units["hw.gpu.temperature"] == "Cel" and units["hw.gpu.utilization"] == "1"


def test_values_converted_to_contract_units(hw):
    start, reader = hw
    gpu = FakeGpu(0)
    gpu.memory = (80 * 2**30, 60 * 2**30, 20 * 2**30)
    gpu.sm_clock_mhz, gpu.power_mw, gpu.temperature_c = 1755, 412_500, 71
    gpu.pcie_kb_s = (3, 5)
    handle = start(gpu)
    handle.collect_once()
    got = points(reader)
    assert by_gpu(got, "hw.gpu.memory.limit") == {0: 80 * 2**30}
    assert by_gpu(got, "hw.gpu.memory.free") == {0: 60 * 2**30}
    assert by_gpu(got, "hw.gpu.memory.usage") == {0: 20 * 2**30}
    assert by_gpu(got, "hw.gpu.clock.sm") == {0: 1755e6}
    assert by_gpu(got, "hw.gpu.power.draw") == {0: 412.5}
    assert by_gpu(got, "hw.gpu.temperature") == {0: 71}
    pcie = {a["network.io.direction"]: v for a, v in got["hw.gpu.pcie.throughput"]}
    assert pcie == {"transmit": 3 * 1024, "receive": 5 * 1024}


def test_utilization_is_the_average_of_buffered_samples(hw, fake_nvml):  # noqa: F811
    start, reader = hw
    gpu = FakeGpu(0)
    gpu.push_utilization(90, 90, 50)  # history from before we started: only the newest counts
    gpu.push_utilization(20, 60, memory=True)
    handle = start(gpu)
    handle.collect_once()
    got = points(reader)
    assert by_gpu(got, "hw.gpu.utilization") == {0: pytest.approx(0.5)}
    assert by_gpu(got, "hw.gpu.memory.controller.utilization") == {0: pytest.approx(0.6)}

    gpu.push_utilization(10, 20, 30)  # between two ticks the driver buffered three samples
    gpu.push_utilization(10, 30, memory=True)
    handle.collect_once()
    gpu.push_utilization(40)
    handle.collect_once()
    got = points(reader)
    assert by_gpu(got, "hw.gpu.utilization") == {0: pytest.approx(0.25)}
    assert by_gpu(got, "hw.gpu.memory.controller.utilization") == {0: pytest.approx(0.2)}

    handle.collect_once()  # NVML_ERROR_NOT_FOUND: nothing new since the last sample
    assert by_gpu(points(reader), "hw.gpu.utilization") == {0: pytest.approx(0.40)}
    assert fake_nvml.calls("nvmlDeviceGetUtilizationRates") == 0


def test_empty_sample_buffer_reads_an_instant_value_first(hw, fake_nvml):  # noqa: F811
    start, reader = hw
    gpu = FakeGpu(0)
    gpu.utilization = (35, 12)
    handle = start(gpu)
    handle.collect_once()  # nothing buffered yet: one instant read, not an absent gauge
    got = points(reader)
    assert by_gpu(got, "hw.gpu.utilization") == {0: pytest.approx(0.35)}
    assert by_gpu(got, "hw.gpu.memory.controller.utilization") == {0: pytest.approx(0.12)}
    gpu.push_utilization(80)
    handle.collect_once()
    handle.collect_once()
    assert by_gpu(points(reader), "hw.gpu.utilization") == {0: pytest.approx(0.80)}
    assert fake_nvml.calls("nvmlDeviceGetUtilizationRates") == 1


def test_falls_back_to_utilization_rates_without_buffered_samples(hw, caplog):
    start, reader = hw
    gpu = FakeGpu(0)
    gpu.unsupported = {"nvmlDeviceGetSamples"}
    handle = start(gpu)
    with caplog.at_level(logging.INFO, logger="otel_training.hardware"):
        for gpu_pct, mem_pct in ((20, 5), (40, 15)):
            gpu.utilization = (gpu_pct, mem_pct)
            handle.collect_once()
    got = points(reader)
    assert by_gpu(got, "hw.gpu.utilization") == {0: pytest.approx(0.30)}
    assert by_gpu(got, "hw.gpu.memory.controller.utilization") == {0: pytest.approx(0.10)}
    fallbacks = [r for r in caplog.records if "nvmlDeviceGetUtilizationRates" in r.getMessage()]
    assert len(fallbacks) == 2  # one per sampling type (GPU, memory), not one per tick


def test_not_supported_removes_only_that_gauge(hw, caplog):
    start, reader = hw
    gpus = [FakeGpu(0), FakeGpu(1)]
    for gpu in gpus:
        gpu.unsupported = {"nvmlDeviceGetPowerUsage"}
    handle = start(*gpus)
    with caplog.at_level(logging.INFO, logger="otel_training.hardware"):
        for _ in range(3):
            handle.collect_once()
    got = points(reader)
    assert "hw.gpu.power.draw" not in got
    assert GPU_GAUGES - {"hw.gpu.power.draw"} <= set(got)
    lines = [r.getMessage() for r in caplog.records if "not available" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "power" in lines[0] and "hw.gpu.power.draw" in lines[0]
    assert all(r.levelno < logging.ERROR for r in caplog.records)


def test_not_supported_after_samples_drops_the_series(hw):
    start, reader = hw
    gpu = FakeGpu(0)
    handle = start(gpu)
    handle.collect_once()
    assert by_gpu(points(reader), "hw.gpu.temperature") == {0: 45}
    gpu.unsupported = {"nvmlDeviceGetTemperature"}
    handle.collect_once()
    assert "hw.gpu.temperature" not in points(reader)  # gone, not frozen at 45 or zeroed


def test_transient_error_keeps_the_series_and_retries(hw, fake_nvml, caplog):  # noqa: F811
    start, reader = hw
    gpu = FakeGpu(0)
    handle = start(gpu)
    handle.collect_once()
    gpu.errors = {"nvmlDeviceGetMemoryInfo": fake_nvml.NVML_ERROR_UNKNOWN}
    with caplog.at_level(logging.INFO, logger="otel_training.hardware"):
        handle.collect_once()
        handle.collect_once()
    assert by_gpu(points(reader), "hw.gpu.memory.usage") == {0: 2**30}  # last known
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 1
    gpu.errors = {}
    gpu.memory = (80 * 2**30, 70 * 2**30, 10 * 2**30)
    handle.collect_once()
    assert by_gpu(points(reader), "hw.gpu.memory.usage") == {0: 10 * 2**30}


@pytest.mark.parametrize("code", ["NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED"])
def test_no_driver_means_no_gpu_gauges_and_no_exception(hw, fake_nvml, caplog, code):  # noqa: F811
    start, reader = hw
    with caplog.at_level(logging.INFO, logger="otel_training.hardware"):
        handle = start(FakeGpu(0), init_error=getattr(fake_nvml, code))
        handle.collect_once()
        handle.collect_once()
    got = points(reader)
    assert not (GPU_GAUGES | PROCESS_GAUGES) & set(got)
    assert "system.linux.memory.available" in got  # host metrics unaffected
    [line] = [r.getMessage() for r in caplog.records if "no GPU metrics" in r.getMessage()]
    assert "NVMLError_" in line


def test_no_gpu(hw, caplog):
    start, reader = hw
    with caplog.at_level(logging.INFO, logger="otel_training.hardware"):
        handle = start()
        handle.collect_once()
    assert not (GPU_GAUGES | PROCESS_GAUGES) & set(points(reader))
    assert sum("found no GPU" in r.getMessage() for r in caplog.records) == 1


def test_pynvml_not_installed(hw, monkeypatch, caplog):
    import sys
    start, reader = hw
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with caplog.at_level(logging.INFO, logger="otel_training.hardware"):
        handle = start(FakeGpu(0))
        handle.collect_once()
    assert not GPU_GAUGES & set(points(reader))
    assert any("not installed" in r.getMessage() for r in caplog.records)


def test_throttle_share_of_samples(hw, fake_nvml):  # noqa: F811
    start, reader = hw
    gpu = FakeGpu(0)
    handle = start(gpu)
    for mask in (fake_nvml.nvmlClocksEventReasonSwPowerCap
                 | fake_nvml.nvmlClocksEventReasonHwThermalSlowdown,
                 fake_nvml.nvmlClocksEventReasonSwPowerCap, 0, 0):
        gpu.throttle_mask = mask
        handle.collect_once()
    shares = {a["hw.gpu.throttle.reason"]: v for a, v in points(reader)["hw.gpu.throttle"]}
    assert shares["sw_power_cap"] == pytest.approx(0.5)
    assert shares["hw_thermal_slowdown"] == pytest.approx(0.25)
    assert shares["gpu_idle"] == 0.0
    assert len(shares) == 9


def test_old_driver_uses_deprecated_throttle_reasons(hw, fake_nvml):  # noqa: F811
    start, reader = hw
    gpu = FakeGpu(0)
    gpu.errors = {"nvmlDeviceGetCurrentClocksEventReasons":
                  fake_nvml.NVML_ERROR_FUNCTION_NOT_FOUND}
    gpu.throttle_mask = fake_nvml.nvmlClocksThrottleReasonHwSlowdown
    handle = start(gpu)
    handle.collect_once()
    handle.collect_once()
    shares = {a["hw.gpu.throttle.reason"]: v for a, v in points(reader)["hw.gpu.throttle"]}
    assert shares["hw_slowdown"] == 1.0
    assert fake_nvml.calls("nvmlDeviceGetCurrentClocksEventReasons") == 1  # not retried


def test_process_memory_and_utilization_are_this_process_only(hw):
    start, reader = hw
    me, other = os.getpid(), os.getpid() + 1
    gpus = [FakeGpu(0), FakeGpu(1)]
    gpus[0].processes = [(other, 5 * 2**30), (me, 3 * 2**30)]
    gpus[1].processes = [(other, 7 * 2**30)]  # we do not use GPU 1
    handle = start(*gpus)
    handle.collect_once()  # first read: buffered history is skipped
    gpus[0].push_process_utilization(me, 60, 80)
    gpus[0].push_process_utilization(other, 5)
    handle.collect_once()
    got = points(reader)
    memory = got["process.gpu.memory.usage"]
    assert [(a["gpu.index"], a["process.pid"], v) for a, v in memory] == [(0, me, 3 * 2**30)]
    assert memory[0][0]["hw.id"] == gpus[0].uuid
    util = got["process.gpu.utilization"]
    assert [(a["gpu.index"], a["process.pid"]) for a, _ in util] == [(0, me)]
    assert util[0][1] == pytest.approx(0.70)

    gpus[0].processes = [(other, 5 * 2**30)]  # we freed our context: a real zero
    handle.collect_once()
    assert by_gpu(points(reader), "process.gpu.memory.usage") == {0: 0}


def test_stale_process_utilization_is_dropped(hw):
    start, reader = hw
    me = os.getpid()
    gpu = FakeGpu(0)
    handle = start(gpu)
    sampler = handle._sampler
    sampler.tick(now=0.0)
    gpu.push_process_utilization(me, 50)
    sampler.tick(now=1.0)
    assert by_gpu(points(reader), "process.gpu.utilization") == {0: 0.5}
    sampler.tick(now=5.0)
    assert by_gpu(points(reader), "process.gpu.utilization") == {0: 0.5}  # last known
    sampler.tick(now=30.0)  # NVML has reported nothing for us for a long time
    assert "process.gpu.utilization" not in points(reader)


def test_only_the_lock_holder_samples_gpus(hw, tmp_path):
    start, reader = hw
    me = os.getpid()
    gpu = FakeGpu(0)
    gpu.processes = [(me, 2**30)]
    other = HostLock(str(tmp_path / "hw.lock"))
    assert other.try_acquire()  # another rank holds the host
    handle = start(gpu)
    handle.collect_once()
    got = points(reader)
    assert not handle.is_host_sampler
    assert not GPU_GAUGES & set(got)
    assert not {"system.cpu.utilization", "system.linux.memory.available"} & set(got)
    assert by_gpu(got, "process.gpu.memory.usage") == {0: 2**30}  # its own usage: always
    other.release()
    handle.collect_once()
    assert handle.is_host_sampler
    assert GPU_GAUGES - {"hw.gpu.utilization", "hw.gpu.memory.controller.utilization"} <= set(
        points(reader))
