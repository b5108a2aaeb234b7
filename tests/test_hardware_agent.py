"""``otel-training agent``: OTLP export of the hardware gauges, signals, bounded shutdown."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from otel_training.cli import agent
from tests.fake_pynvml import FakeGpu, fake_nvml  # noqa: F401 (fixture)
from tests.otlp_receiver import OTLPReceiver, attributes, data_points, free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A private temp dir (so the per-host lock is ours) and a clean OTEL_* environment."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for var in list(os.environ):
        if var.startswith("OTEL_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    return monkeypatch


def test_exports_hardware_gauges_over_otlp(env, fake_nvml):  # noqa: F811
    with OTLPReceiver() as receiver:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        t0 = time.monotonic()
        assert agent.main(["--interval", "0.05", "--duration", "1"]) == 0
        assert time.monotonic() - t0 < 4
        metrics = receiver.metrics()
    by_name = {}
    for resource, metric in metrics:
        by_name.setdefault(metric.name, []).append((resource, metric))
    for name in ("system.cpu.utilization", "system.linux.memory.available",
                 "hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.power.draw"):
        assert name in by_name, sorted(by_name)
    resource, metric = by_name["hw.gpu.memory.usage"][-1]
    assert resource["service.name"] == "otel-training-agent"
    [point] = data_points(metric)
    attrs = attributes(point.attributes)
    assert attrs["host.name"] == resource["host.name"]
    assert attrs["hw.id"] == FakeGpu(0).uuid and attrs["hw.type"] == "gpu"
    assert metric.WhichOneof("data") == "gauge"


def test_agent_argument_is_accepted_and_service_name_honoured(env, fake_nvml):  # noqa: F811
    with OTLPReceiver() as receiver:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        env.setenv("OTEL_SERVICE_NAME", "gpu-node-agent")
        assert agent.main(["agent", "--duration", "0.5", "--interval", "0.1"]) == 0
        services = {res["service.name"] for res, _ in receiver.metrics()}
    assert services == {"gpu-node-agent"}


def test_unreachable_collector_does_not_hold_the_exit(env, fake_nvml):  # noqa: F811
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    env.setenv("OTEL_TRAINING_SHUTDOWN_TIMEOUT", "0.5")
    t0 = time.monotonic()
    assert agent.main(["--duration", "0.3", "--interval", "0.1"]) == 0
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("argv, variable", [
    (["--interval", "0"], None),
    (["--duration", "soon"], None),
    ([], ("OTEL_TRAINING_HARDWARE_INTERVAL", "fast")),
    ([], ("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")),
])
def test_bad_input_exits_2_with_one_line(env, capsys, argv, variable):
    if variable:
        env.setenv(*variable)
    assert agent.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err
    if variable:
        assert err.count("\n") == 0 and variable[0] in err


def test_sigterm_stops_the_agent(tmp_path):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environ.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path),
                   OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}",
                   OTEL_TRAINING_SHUTDOWN_TIMEOUT="0.5")
    proc = subprocess.Popen([sys.executable, "-m", "otel_training.cli.agent", "--interval", "0.1"],
                            cwd=ROOT, env=environ, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        for line in proc.stderr:  # wait until it runs
            if "sampling hardware every" in line or time.monotonic() > deadline:
                break
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 3
    finally:
        proc.kill()
