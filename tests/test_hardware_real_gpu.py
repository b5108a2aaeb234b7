"""The real NVML on a CUDA machine (skipped where ``pynvml.nvmlInit()`` fails)."""

import os
import sys
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_training.config import Config
from tests.conftest import reader_points
from otel_training.hardware import start_hardware_metrics

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nvml():
    module = sys.modules.get("pynvml")
    if module is not None and "fake" in (getattr(module, "__file__", "") or ""):
        pytest.skip("pynvml is faked in this process")
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        pytest.skip(f"no NVML here: {exc}")
    yield pynvml
    pynvml.nvmlShutdown()


points = reader_points


def test_real_gpus_report_identity_and_plausible_values(nvml, tmp_path):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    hw = start_hardware_metrics(provider, Config(), host_name="gpu-host",
                                lock_path=str(tmp_path / "l"), start=False)
    try:
        for _ in range(3):
            hw.collect_once()
            time.sleep(0.2)
        got = points(reader)
    finally:
        hw.shutdown()
        provider.shutdown()
    count = nvml.nvmlDeviceGetCount()
    uuids = {nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)}
    limits = got["hw.gpu.memory.limit"]
    assert {a["hw.id"] for a, _ in limits} == uuids
    for attrs, value in limits:
        handle = nvml.nvmlDeviceGetHandleByIndex(attrs["gpu.index"])
        assert value == nvml.nvmlDeviceGetMemoryInfo(handle).total
        assert attrs["hw.model"] == nvml.nvmlDeviceGetName(handle)
    for attrs, value in got["hw.gpu.utilization"]:
        assert 0.0 <= value <= 1.0
    for attrs, value in got.get("hw.gpu.temperature", []):
        assert 0 < value < 120


def test_this_process_gpu_memory(nvml, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA in torch")
    x = torch.ones(64 * 2**20, device="cuda")  # 256 MiB
    handle = nvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    if os.getpid() not in {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}:
        pytest.skip("NVML lists processes in another PID namespace (container)")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    hw = start_hardware_metrics(provider, Config(), host_name="gpu-host",
                                lock_path=str(tmp_path / "l"), start=False)
    try:
        hw.collect_once()
        mine = points(reader)["process.gpu.memory.usage"]
    finally:
        hw.shutdown()
        provider.shutdown()
    assert any(a["process.pid"] == os.getpid() and v >= 256 * 2**20 for a, v in mine)
    del x
