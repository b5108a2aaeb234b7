"""``otel-training compare`` on real runs of ``examples/slow_input_pipeline.py``:
before/after ``num_workers`` it says improvement, names ``dataloader_next`` and shows
the step-time delta; two runs of the same configuration say inconclusive. Runs with
planted step times (a sleep in each step) check the words against the noise and the CI
gate ``--fail-on-regression PCT``.

The three runs go concurrently, each with one intra-op thread: on a shared 2-core
machine, runs one after the other see different loads (another job starts) and
differ by more than any noise floor a useful comparison can have; side by side they
see the same load. ``docs/report.md`` explains the noise model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_training.cli import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("compare")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_TRAINING_HARDWARE="false",
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OMP_NUM_THREADS="1",
        OTEL_PYTHON_DISTRO="otel_training",
        OTEL_PYTHON_CONFIGURATOR="otel_training",
    )
    procs = {}
    for name, workers in (("before", 0), ("after", 4), ("again", 0)):
        procs[name] = subprocess.Popen(
            [
                str(BIN / "opentelemetry-instrument"),
                "--service_name",
                "slow-pipeline",
                sys.executable,
                "examples/slow_input_pipeline.py",
                "--steps",
                "40",
                "--workers",
                str(workers),
            ],
            cwd=ROOT,
            env=dict(env, OTEL_TRAINING_SUMMARY_FILE=str(d / f"{name}.json")),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    return {name: str(d / f"{name}.json") for name in procs}


def _compare(capsys, *argv):
    code = main(["compare", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_more_workers_is_an_improvement_in_dataloader_next(runs, capsys):
    c = json.loads(_compare(capsys, runs["before"], runs["after"], "--json"))
    assert c["result"] == "improvement", c["step"]
    assert c["changed_phase"] == "dataloader_next"
    step = c["step"]
    assert step["b"] < 0.7 * step["a"] and step["delta"] == pytest.approx(step["b"] - step["a"])
    assert c["throughput"]["b"] > c["throughput"]["a"]
    dl = next(p for p in c["phases"] if p["name"] == "dataloader_next")
    assert dl["change"] == "improvement" and dl["share_b"] < dl["share_a"]
    assert c["verdict"]["a"]["kind"] == "data_loading"
    text = _compare(capsys, runs["before"], runs["after"])
    result = text.strip().splitlines()[-1]
    assert result.startswith("result: improvement: time per step ")
    assert f"({100 * step['delta_rel']:+.1f}%;" in result and "dataloader_next changed most (-" in result
    row = next(line for line in text.splitlines() if line.strip().startswith("time per step ms"))
    assert f"{step['delta'] * 1e3:+.1f} ms" in row and row.rstrip().endswith("improvement")


def test_the_same_configuration_is_inconclusive(runs, capsys):
    c = json.loads(_compare(capsys, runs["before"], runs["again"], "--json"))
    assert c["result"] == "inconclusive", c["step"]
    assert c["changed_phase"] is None
    assert abs(c["step"]["delta"]) <= c["step"]["threshold"]
    assert c["step"]["noise"] is not None  # estimated from the runs' own windows
    assert _compare(capsys, runs["before"], runs["again"]).strip().splitlines()[-1].startswith("result: inconclusive: ")


def test_compare_errors(tmp_path, runs, capsys):
    assert main(["compare", str(tmp_path / "nope.json"), runs["after"]]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "x-*.json"), runs["after"]]) == 2
    assert "no summary file matches" in capsys.readouterr().err
    assert main(["compare", runs["before"], runs["after"], "--mode", "eval"]) == 2
    assert "no eval steps" in capsys.readouterr().err
    assert main(["compare", runs["before"], runs["after"], "--threshold", "2"]) == 2
    assert "--threshold" in capsys.readouterr().err


# ------------------------------------------------------------- planted step times
# Each step sleeps STEP_MS (the first half of the steps SLOW_MS instead when set): a
# steady run has little noise, a run whose first half is slow a lot (its block means
# differ by the whole planted difference).
PLANTED = r"""
import os, time, torch
steps = 40
fast, slow = float(os.environ["STEP_MS"]) / 1e3, float(os.environ.get("SLOW_MS") or os.environ["STEP_MS"]) / 1e3
m = torch.nn.Linear(8, 2); opt = torch.optim.SGD(m.parameters(), 0.1)
x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
for i in range(steps):
    time.sleep(slow if i < steps // 2 else fast)
    loss = torch.nn.functional.cross_entropy(m(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    d = tmp_path_factory.mktemp("planted")
    script = d / "train.py"
    script.write_text(PLANTED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_TRAINING_HARDWARE="false",
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OMP_NUM_THREADS="1",
        OTEL_PYTHON_DISTRO="otel_training",
        OTEL_PYTHON_CONFIGURATOR="otel_training",
    )
    # noisy: 20 steps of 250 ms, then 20 of 10 ms (mean 130 ms, block means 250 or 10)
    runs = {"noisy": {"STEP_MS": "10", "SLOW_MS": "250"}, "steady80": {"STEP_MS": "80"}, "steady40": {"STEP_MS": "40"}}
    procs = {
        name: subprocess.Popen(
            [str(BIN / "opentelemetry-instrument"), sys.executable, str(script)],
            cwd=ROOT,
            env=dict(env, **extra, OTEL_TRAINING_SUMMARY_FILE=str(d / f"{name}.json")),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, extra in runs.items()
    }
    for p in procs.values():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    return {name: str(d / f"{name}.json") for name in procs}


def _status(capsys, *argv):
    code = main(["compare", *argv])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    return code, out


def test_a_large_change_inside_the_noise_is_inconclusive_with_the_noise(planted, capsys):
    """~-40% step time that a run's own spread explains (the issue's '-40.9% step time:
    no change' beside noise of ±45%): inconclusive, with the noise, never 'no change'."""
    code, out = _status(capsys, planted["noisy"], planted["steady80"], "--json")
    c = json.loads(out)
    s = c["step"]
    assert code == 0 and c["result"] == "inconclusive", s
    # planted 130 -> 80 ms per step: most of the -50 ms (the runs' compute, stretched on a
    # loaded machine, is on both sides and shrinks the ratio, not the difference)
    assert s["delta"] < -0.035 and s["delta_rel"] < -0.15, s
    assert s["noise"] is not None and 3 * s["noise"] > abs(s["delta"])  # the noise explains it
    assert c["changed_phase"] is None
    code, text = _status(capsys, planted["noisy"], planted["steady80"])
    result = text.strip().splitlines()[-1]
    assert result.startswith("result: inconclusive: time per step ") and "no change" not in text
    assert f"({100 * s['delta_rel']:+.1f}%; noise ±{100 * s['noise'] / s['a']:.1f}%" in result, result
    assert result.endswith(": within the noise)"), result
    row = next(line for line in text.splitlines() if line.strip().startswith("time per step ms"))
    assert row.rstrip().endswith("inconclusive"), row


def test_fail_on_regression_is_a_ci_gate(planted, capsys):
    """steady 40 -> 80 ms per step: a regression of ~+100%, far beyond the noise."""
    a, b = planted["steady40"], planted["steady80"]
    code, out = _status(capsys, a, b, "--fail-on-regression", "10")
    assert code == 1
    lines = out.strip().splitlines()
    assert lines[-2].startswith("result: regression: time per step ")
    assert lines[-1].startswith("gate: fail: time per step +") and "worse by more than the allowed 10%" in lines[-1]
    code, out = _status(capsys, a, b, "--fail-on-regression", "300", "--json")
    c = json.loads(out)
    assert code == 0 and c["result"] == "regression" and c["gate"]["failed"] is False
    # The change as the runs' own files have it (their compute on a loaded machine adds to
    # both sides, so the ratio is not the planted 2x): B's time per step over A's, less 1.
    per_step = {}
    for name, path in (("a", a), ("b", b)):
        train = json.loads(Path(path).read_text())["modes"]["train"]
        per_step[name] = train["step_time_s"] / train["steps"]
    assert c["gate"]["beyond_noise"] is True
    assert c["gate"]["delta_rel"] == pytest.approx(per_step["b"] / per_step["a"] - 1, rel=0.05), per_step
    assert per_step["b"] - per_step["a"] > 0.03  # most of the planted 40 ms
    # faster is never a failed gate; nor is a slower run whose own noise explains it
    assert _status(capsys, b, a, "--fail-on-regression", "0")[0] == 0
    code, out = _status(capsys, planted["steady80"], planted["noisy"], "--fail-on-regression", "10")
    assert code == 0, out
    assert "gate: pass: " in out and "not significant" in out.splitlines()[-1], out
    # without the flag, a regression still exits 0
    assert _status(capsys, a, b)[0] == 0


def test_fail_on_regression_errors(planted, capsys):
    assert main(["compare", planted["steady40"], planted["steady80"], "--fail-on-regression", "-5"]) == 2
    err = capsys.readouterr().err
    assert "--fail-on-regression -5 is not valid: use a percentage >= 0" in err and len(err.splitlines()) == 1
