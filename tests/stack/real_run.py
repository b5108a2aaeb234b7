"""Run the real instrumented training example and collect its OTLP export.

``examples/train_basic.py`` (plain PyTorch, no OpenTelemetry in it) runs as two
torchrun ranks, launched as the README says (``opentelemetry-instrument torchrun ...``,
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


def run_training(endpoint: str, *, ranks: int = 2, steps: int = 60, timeout: float = 300) -> str:
    """Train to ``endpoint``; returns the captured output (raises on failure)."""
    with tempfile.TemporaryDirectory(prefix="otel-stack-run-") as tmp:
        env = dict(os.environ)
        env.update({
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_SERVICE_NAME": SERVICE,
            "OTEL_PYTHON_DISTRO": "otel_training",
            "OTEL_PYTHON_CONFIGURATOR": "otel_training",
            "OTEL_METRIC_EXPORT_INTERVAL": "500",
            "OTEL_TRAINING_HARDWARE_INTERVAL": "0.1",
            "OTEL_TRAINING_TRACE_EVERY_N": "5",
            "PYTHONPATH": os.pathsep.join([str(FAKE_GPU_SITE), str(ROOT)]),
            "TMPDIR": tmp,  # the per-host hardware lock: private to this run
            "OMP_NUM_THREADS": "1",
        })
        cmd = [str(BIN / "opentelemetry-instrument"), str(BIN / "torchrun"), "--standalone",
               f"--nproc_per_node={ranks}", str(ROOT / "examples" / "train_basic.py"),
               "--steps", str(steps), "--batch-delay-ms", "20", "--log-delay-ms", "5"]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 or "Traceback" in output:
        raise RuntimeError(f"training run failed ({proc.returncode}):\n{output[-4000:]}")
    return output
