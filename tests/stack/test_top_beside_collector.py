"""``otel-training top`` beside the stack: the real Collector, on the shipped
configuration with docs/live.md's exporter merged in, passes a job's metrics on to the
viewer, and the viewer's numbers are the run's summary's."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from otel_training.live.receiver import Receiver
from otel_training.live.report import live_report
from otel_training.live.state import LiveRun
from tests.otlp_receiver import free_port
from tests.scripts.harness import BIN, ROOT, SCRIPTS

pytestmark = [pytest.mark.slow, pytest.mark.sdk_independent]


def _docs_snippet(port: int) -> str:
    text = (ROOT / "docs" / "live.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert "127.0.0.1:14317" in block
    return block.replace("127.0.0.1:14317", f"127.0.0.1:{port}")


def _listening(port: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


def test_the_collector_passes_a_jobs_metrics_on_to_the_viewer(tmp_path: Path, stack_bin: Path):
    run = LiveRun()
    receiver = Receiver(run.add, "127.0.0.1:0", None).start()
    (tmp_path / "top.yaml").write_text(_docs_snippet(receiver.grpc_port or 0))
    grpc, http, health, telemetry = (free_port() for _ in range(4))
    env = dict(os.environ, COLLECTOR_LISTEN_HOST="127.0.0.1", OTLP_GRPC_PORT=str(grpc), OTLP_HTTP_PORT=str(http),
               COLLECTOR_HEALTH_PORT=str(health), COLLECTOR_METRICS_PORT=str(telemetry),
               PROMETHEUS_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}/api/v1/otlp",  # (nobody: not this test's)
               TEMPO_OTLP_ENDPOINT=f"127.0.0.1:{free_port()}")
    collector = subprocess.Popen([str(stack_bin / "otelcol"), "--config", str(ROOT / "collector-config" / "config.yaml"),
                                  "--config", str(tmp_path / "top.yaml")], env=env, stdout=subprocess.DEVNULL,
                                 stderr=open(tmp_path / "otelcol.log", "w"))
    try:
        assert _listening(grpc, 60), (tmp_path / "otelcol.log").read_text()[-3000:]
        job_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        job_env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{grpc}", OTEL_METRIC_EXPORT_INTERVAL="1000",
                       OTEL_SERVICE_NAME="top-beside", OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "summary.json"))
        r = subprocess.run([str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(SCRIPTS / "train_top.py"),
                            "--steps", "40"], env=job_env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr
        summary = json.loads((tmp_path / "summary.json").read_text())["modes"]["train"]
        end = time.monotonic() + 30  # the Collector's batch processor holds metrics up to 1 s
        while time.monotonic() < end:
            live = live_report(run).modes.get("train")
            if live is not None and live.steps == summary["steps"]:
                break
            time.sleep(0.2)
    finally:
        collector.terminate()
        collector.wait(20)
        receiver.stop()
    assert live is not None and live.steps == summary["steps"] == 40, (live, summary["steps"])
    assert {run.processes[k].resource.get("service.name") for k in run.processes} == {"top-beside"}
    shares = {p.name: p.share for p in live.top_phases()}
    one_step = summary["step_max_s"] / summary["step_time_s"] + 0.002
    for p in summary["phases"]:
        if p["parent"] == "step":
            assert abs(shares.get(p["name"], 0.0) - p["share"]) <= one_step, (p["name"], shares, p["share"])
