"""Never a silent no-op: whenever ``opentelemetry-instrument`` loads otel-training and it
does not instrument, for a reason the user did not choose, stderr gets exactly one line,
``otel-training: not instrumenting: <cause>; <fix>``; a deliberate off stays quiet; and
the user's loop runs as it would uninstrumented.

The below-the-floor case runs a real torch older than the floor, in the virtualenv
``scripts/test-torch-range.sh`` builds from ``constraints-torch-below.txt``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from otel_training.package import TORCH_FLOOR
from tests.otlp_receiver import OTLPReceiver

ROOT = Path(__file__).resolve().parent.parent
BELOW = ROOT / ".venv-torch-below" / "bin"
LINE = re.compile(r"^otel-training: not instrumenting: (?P<cause>.+); (?P<fix>.+)$")
SCRIPT = ROOT / "examples" / "train_basic.py"
STEPS = "6"


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHON"))}
    env.update(OTEL_TRAINING_SUMMARY="false", OTEL_METRIC_EXPORT_INTERVAL="200", **extra)
    return env


def _run(bindir: Path, env: dict, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    cmd = [str(bindir / "opentelemetry-instrument"), str(bindir / "python"), str(SCRIPT), "--steps", STEPS,
           "--batch-delay-ms", "1", "--log-delay-ms", "0", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=240)


# "otel-training" other than as a folder in a path: torch's own warnings name its files,
# which live under ~/.cache/otel-training/torch/ (scripts/torch-shared.sh) or a clone
# named otel-training/.
OURS = re.compile(r"otel_training|otel-training(?!/)")


def _ours(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if OURS.search(line)]


def _step_spans(receiver: OTLPReceiver) -> list:
    return [s for _, s in receiver.spans() if s.name == "step"]


@pytest.fixture
def below_floor() -> Path:
    if not (BELOW / "python").exists():
        reason = "no .venv-torch-below (scripts/test-torch-range.sh builds it)"
        if _ci():
            pytest.fail(f"{reason} (CI=true: not skipping)")
        pytest.skip(reason)
    return BELOW


def test_torch_below_the_floor_runs_uninstrumented_with_one_line(below_floor):
    version = subprocess.run([str(below_floor / "python"), "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with OTLPReceiver() as receiver:
        proc = _run(below_floor, _env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint))
        spans = _step_spans(receiver)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    lines = _ours(proc.stderr)
    assert len(lines) == 1, proc.stderr
    m = LINE.match(lines[0])
    assert m, lines[0]
    assert f"torch {version.split('+')[0]} " in m["cause"] and f"torch >= {TORCH_FLOOR}" in m["cause"]
    assert f"torch>={TORCH_FLOOR}" in m["fix"]
    assert "Traceback" not in proc.stderr
    assert spans == []


@pytest.mark.parametrize("off", [{"OTEL_TRAINING_ENABLED": "false"},
                                 {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "training"}])
def test_a_deliberate_off_stays_quiet_below_the_floor(below_floor, off):
    proc = _run(below_floor, _env(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", **off))
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    assert _ours(proc.stderr) == [], proc.stderr


def test_in_range_torch_says_nothing_and_exports_every_step():
    """The supported torch of the environment running the suite (each end of the range
    under scripts/test-torch-range.sh): no line from preflight, every step exported."""
    bindir = Path(sys.executable).parent
    with OTLPReceiver() as receiver:
        proc = _run(bindir, _env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_TRAINING_TRACE_EVERY_N="1",
                                 OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000"))
        assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
        assert receiver.wait_for(lambda r: len(_step_spans(r)) >= int(STEPS), timeout=30)
    assert not [line for line in _ours(proc.stderr) if "not instrumenting" in line], proc.stderr


def test_an_integration_that_fails_to_load_gets_one_line(tmp_path):
    """A Lightning layout the integration cannot patch (a ``pytorch_lightning`` with none of
    the classes it wraps): the script imports it and trains; one line names the
    integration, the torch hooks still time every step."""
    fake = tmp_path / "site" / "pytorch_lightning"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('"""A Lightning with none of the classes the integration wraps."""\n')
    script = tmp_path / "train.py"
    script.write_text("import pytorch_lightning\n" + SCRIPT.read_text())
    bindir = Path(sys.executable).parent
    with OTLPReceiver() as receiver:
        env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_TRAINING_INTEGRATIONS="lightning",
                   OTEL_TRAINING_TRACE_EVERY_N="1", OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000",
                   PYTHONPATH=str(tmp_path / "site"))
        cmd = [str(bindir / "opentelemetry-instrument"), str(bindir / "python"), str(script), "--steps", STEPS,
               "--batch-delay-ms", "1", "--log-delay-ms", "0"]
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
        assert receiver.wait_for(lambda r: len(_step_spans(r)) >= int(STEPS), timeout=30)
    lines = [line for line in _ours(proc.stderr) if "not instrumenting" in line]
    assert len(lines) == 1, proc.stderr
    m = LINE.match(lines[0])
    assert m and "lightning integration" in m["cause"] and "AttributeError" in m["cause"], lines[0]
    assert "Traceback" not in proc.stderr


def test_a_failing_set_up_leaves_the_loop_uninstrumented_with_one_line(monkeypatch, capsys):
    """Our own bug while setting up (planted in ``Runtime.install``): one line, nothing left
    attached, and a loop afterwards runs as it would uninstrumented."""
    import torch
    from torch.utils.data import DataLoader

    from otel_training import runtime
    from otel_training.config import load_config
    from otel_training.instrumentor import TrainingInstrumentor
    from otel_training.runtime import notice

    def broken(self):
        self.handles.wrap(DataLoader, "__iter__", lambda wrapped, inst, a, k: wrapped(*a, **k))
        raise RuntimeError("planted set-up failure")

    before = DataLoader.__iter__
    monkeypatch.setattr(runtime.Runtime, "install", broken)
    monkeypatch.setattr(notice, "_said", False)
    config = load_config({"OTEL_TRAINING_SUMMARY": "false", "OTEL_TRAINING_HARDWARE": "false"})
    TrainingInstrumentor()._instrument(config=config)
    try:
        assert TrainingInstrumentor._runtime is None
        assert DataLoader.__iter__ is before
        total = sum(float(b.sum()) for b in DataLoader(torch.arange(8.0), batch_size=4))
        assert total == 28.0
    finally:
        TrainingInstrumentor._runtime = None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and LINE.match(err[0]) and "planted set-up failure" in err[0], err


def test_the_line_is_said_once_per_process(monkeypatch, capsys):
    from otel_training.runtime import notice

    monkeypatch.setattr(notice, "_said", False)
    notice.not_instrumenting("first cause", "first fix")
    notice.not_instrumenting("second cause", "second fix")
    assert capsys.readouterr().err == "otel-training: not instrumenting: first cause; first fix\n"
