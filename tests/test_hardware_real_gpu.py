"""The real NVML on a CUDA machine (skipped where ``pynvml.nvmlInit()`` fails)."""

import os
import sys
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_training.config import Config
from otel_training.hardware import start_hardware_metrics
from tests.conftest import reader_points

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


def test_utilization_agrees_with_nvidia_smi_and_names_this_process(nvml, tmp_path):
    """Half-busy GPU for ~6 s: our window mean of ``hw.gpu.utilization`` against
    nvidia-smi's readings over the same window (within 5 points), and the SM share
    attributed to this process's PID."""
    import shutil
    import subprocess
    import threading

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        pytest.skip("needs CUDA and nvidia-smi")
    index = torch.cuda.current_device()
    a = torch.randn(4096, 4096, device="cuda")
    stop = threading.Event()

    def half_busy() -> None:  # ~50 ms of kernels, ~50 ms idle, over and over
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < 0.05:
                a @ a
                torch.cuda.synchronize()
            time.sleep(0.05)

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    hw = start_hardware_metrics(provider, Config(), host_name="gpu-host",
                                lock_path=str(tmp_path / "l"), start=False)
    load = threading.Thread(target=half_busy, daemon=True)
    try:
        load.start()
        time.sleep(1.0)  # the driver's utilization window fills with the duty cycle
        hw.collect_once()
        points(reader)  # a fresh interval starts here
        smi = subprocess.Popen(
            ["nvidia-smi", "-i", str(index), "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
             "-lms", "200"], stdout=subprocess.PIPE, text=True)
        for _ in range(12):
            time.sleep(0.5)
            hw.collect_once()
        smi.terminate()
        smi_out = smi.communicate(timeout=10)[0]
        got = points(reader)
    finally:
        stop.set()
        load.join(10)
        hw.shutdown()
        provider.shutdown()
    uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index))
    ours = [v for attrs, v in got["hw.gpu.utilization"] if attrs["hw.id"] == uuid]
    readings = [float(line) for line in smi_out.split() if line.strip().isdigit()]
    assert len(ours) == 1 and len(readings) >= 10, (ours, readings)
    smi_mean = sum(readings) / len(readings)
    assert 20 < smi_mean < 80, readings  # the load really was half busy
    assert abs(ours[0] * 100 - smi_mean) <= 5, (ours[0] * 100, smi_mean, readings)
    mine = [(a, v) for a, v in got.get("process.gpu.utilization", []) if a["process.pid"] == os.getpid()]
    assert mine and all(0 < v <= 1 for _, v in mine), got.get("process.gpu.utilization")


def test_the_agent_command_exports_real_gpu_gauges_over_otlp(nvml, tmp_path):
    """``otel-training agent`` (the installed command, as a node runs it) over real OTLP:
    every GPU NVML lists, with its UUID, model and index, real memory totals, a power
    draw and a utilization share."""
    import shutil
    import subprocess

    from tests.otlp_receiver import OTLPReceiver, attributes, data_points

    command = shutil.which("otel-training", path=os.path.dirname(sys.executable)) or shutil.which("otel-training")
    if command is None:
        pytest.skip("the otel-training command is not installed here")
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    totals = {nvml.nvmlDeviceGetUUID(h): nvml.nvmlDeviceGetMemoryInfo(h).total for h in handles}
    with OTLPReceiver() as receiver:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        environ.update(TMPDIR=str(tmp_path), OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                       OTEL_METRIC_EXPORT_INTERVAL="500")
        proc = subprocess.run([command, "agent", "--interval", "0.2", "--duration", "3"], env=environ,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        last = {}
        for resource, metric in receiver.metrics():
            last[metric.name] = (resource, [(attributes(p.attributes), getattr(p, p.WhichOneof("value")))
                                            for p in data_points(metric)])
    for name in ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.power.draw",
                 "hw.gpu.clock.sm", "system.cpu.utilization"):
        assert name in last, f"no {name}: {sorted(last)}"
    resource, limits = last["hw.gpu.memory.limit"]
    assert resource["service.name"] == "otel-training-agent"
    assert {a["hw.id"]: v for a, v in limits} == totals
    for attrs, _ in limits:
        assert attrs["hw.model"] == nvml.nvmlDeviceGetName(handles[attrs["gpu.index"]])
        assert attrs["host.name"] == resource["host.name"]
    assert all(0.0 <= v <= 1.0 for _, v in last["hw.gpu.utilization"][1])
    assert all(v > 0 for _, v in last["hw.gpu.power.draw"][1]) and all(v > 0 for _, v in last["hw.gpu.clock.sm"][1])
