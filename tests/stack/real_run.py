"""Run the real instrumented training example and collect its OTLP export.

``examples/train_basic.py`` (plain PyTorch, no OpenTelemetry in it; DDP over gloo)
runs as two torchrun ranks (the stack tests run two such jobs at once: ``CONCURRENT``), launched as the README says (``opentelemetry-instrument torchrun ...``,
so torchrun's launcher process is instrumented too and usually samples the host's
hardware under its own run id), exporting OTLP/gRPC to a receiver on loopback
(``tests/otlp_receiver.py``). The hardware sampler reads the fake NVML
(``fake_gpu_site/pynvml.py``) since this machine has no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SERVICE = "stack-train"
FAKE_GPU_SITE = Path(__file__).resolve().parent / "fake_gpu_site"


def available() -> bool:
    """Whether the core package, the example and the launchers are there to run."""
    try:
        import otel_training.distro  # noqa: F401
        import otel_training.instrumentor  # noqa: F401
    except ImportError:
        return False
    return all(path.exists() for path in (ROOT / "examples" / "train_basic.py",
                                          BIN / "opentelemetry-instrument", BIN / "torchrun"))


def _command(ranks: int, steps: int, batch_delay_ms: float, log_delay_ms: float) -> list:
    return [str(BIN / "opentelemetry-instrument"), str(BIN / "torchrun"), "--standalone",
            f"--nproc_per_node={ranks}", str(ROOT / "examples" / "train_basic.py"),
            "--steps", str(steps), "--batch-delay-ms", str(batch_delay_ms),
            "--log-delay-ms", str(log_delay_ms)]


def _env(endpoint: str, tmp: str) -> dict:
    env = dict(os.environ)
    env.update({
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_SERVICE_NAME": SERVICE,
        "OTEL_PYTHON_DISTRO": "otel_training",
        "OTEL_PYTHON_CONFIGURATOR": "otel_training",
        "OTEL_METRIC_EXPORT_INTERVAL": "100",  # many exports: replayed at 1-60 s intervals
        "OTEL_TRAINING_HARDWARE_INTERVAL": "0.1",
        "OTEL_TRAINING_TRACE_EVERY_N": "5",
        "OTEL_TRAINING_PEAK_FLOPS": "1e11",  # a CPU has no table peak: MFU needs one given
        "PYTHONPATH": os.pathsep.join([str(FAKE_GPU_SITE), str(ROOT)]),
        "TMPDIR": tmp,  # the per-host hardware lock: private to this test
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",  # the ranks' DDP (gloo) on loopback
    })
    return env


def run_training(endpoint: str, *, ranks: int = 2, steps: int = 60, timeout: float = 300) -> str:
    """Train to ``endpoint``; returns the captured output (raises on failure)."""
    return run_concurrently(endpoint, [dict(ranks=ranks, steps=steps)], timeout=timeout)[0]


# Two runs of one job at once on one host (a sweep): their data waits and step times
# differ, so any panel that blends them shows numbers neither run has.
# About 6 s of training each: 60 exports of every rank.
CONCURRENT = [
    dict(ranks=2, steps=240, batch_delay_ms=20, log_delay_ms=5),
    dict(ranks=2, steps=300, batch_delay_ms=2, log_delay_ms=15),
]


def run_concurrently(endpoint: str, runs: list, timeout: float = 300) -> list:
    """Start every run in ``runs`` (keyword sets: ranks, steps, batch_delay_ms,
    log_delay_ms) at once, as separate torchrun jobs of the same service on this host
    sharing the per-host hardware lock, and wait for all; returns their outputs."""
    with tempfile.TemporaryDirectory(prefix="otel-stack-run-") as tmp:
        env = _env(endpoint, tmp)
        procs = []
        try:
            for spec in runs:
                cmd = _command(spec.get("ranks", 2), spec.get("steps", 60),
                               spec.get("batch_delay_ms", 20), spec.get("log_delay_ms", 5))
                procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
            outputs = []
            for proc in procs:
                out, _ = proc.communicate(timeout=timeout)
                if proc.returncode != 0 or "Traceback" in out:
                    raise RuntimeError(f"training run failed ({proc.returncode}):\n{out[-4000:]}")
                outputs.append(out)
            return outputs
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
