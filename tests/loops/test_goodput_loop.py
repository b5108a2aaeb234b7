"""The whole job, second by second (the summary's ``job`` section, aggregate/job.py),
against the scripts' own clocks, as a new user runs them: under
``opentelemetry-instrument``, no otel-training import.

- ``goodput_epochs``: start-up work, 3 epochs of train steps, eval, a ``torch.save``
  checkpoint onto a slow filesystem and a blocking upload each: every activity within
  15% of the script's clock (start-up within 20%), goodput within 0.03, the self-check
  silent, the run-end table's goodput bar, and the exported ``training.job.time`` and
  ``training.goodput`` agreeing with the summary;
- ``compile_loop``: a ``torch.compile``d model (aot_eager on the CPU): ``compile``
  within 20% of torch's own compile-time counters, its recompilation (the first eval
  step under no_grad) found and placed in that step.

Bounds are one-sided where a bug moves a number one way only; the planted times are
tenths of seconds, far above a loaded machine's noise at the activities' edges.
"""

from __future__ import annotations

import pytest

from tests.loops._run import run_loop

pytestmark = pytest.mark.slow

ACTIVITY_TOLERANCE = 0.15
STARTUP_TOLERANCE = 0.20
GOODPUT_TOLERANCE = 0.03
COMPILE_TOLERANCE = 0.20


@pytest.fixture(scope="module")
def epochs():
    run = run_loop("goodput_epochs", extra_env={"OTEL_TRAINING_SUMMARY": "true"})
    assert run.error is None and run.returncode == 0, f"{run.error or run.returncode}\n{run.stderr_tail()}"
    assert "Traceback" not in run.stderr, run.stderr_tail()
    return run


@pytest.fixture(scope="module")
def compiled():
    run = run_loop("compile_loop")
    assert run.error is None and run.returncode == 0, f"{run.error or run.returncode}\n{run.stderr_tail()}"
    return run


def _job_truth(run) -> dict:
    job = run.truth["notes"].get("job")
    if job is None:
        pytest.skip("no /proc here: the script cannot tell when its process started")
    return job


@pytest.mark.parametrize("activity", ["startup", "train", "eval", "checkpoint", "other", "shutdown"])
def test_every_activity_matches_the_scripts_clock(epochs, activity):
    truth = _job_truth(epochs)[f"{activity}_s"]
    got = epochs.summary["job"]["activities"][activity]
    tolerance = STARTUP_TOLERANCE if activity == "startup" else ACTIVITY_TOLERANCE
    assert abs(got - truth) <= tolerance * truth, (
        f"{activity}: {got:.3f} s in the summary, {truth:.3f} s by the script's clock "
        f"(all: {epochs.summary['job']['activities']}; script: {_job_truth(epochs)})")


def test_goodput_and_wall_time(epochs):
    truth, job = _job_truth(epochs), epochs.summary["job"]
    assert abs(job["goodput"] - truth["goodput"]) <= GOODPUT_TOLERANCE, (job["goodput"], truth["goodput"])
    assert abs(job["wall_s"] - truth["wall_s"]) <= ACTIVITY_TOLERANCE * truth["wall_s"]
    assert sum(job["activities"].values()) == pytest.approx(job["wall_s"], rel=1e-6)
    assert job["start"] == "proc"


def test_the_checkpoints_are_found_as_saves(epochs):
    ckpt = epochs.summary["job"]["checkpoint"]
    assert ckpt["saves"] == epochs.truth["notes"]["epochs"] and ckpt["loads"] == 0, ckpt
    assert [c["name"] for c in ckpt["calls"]] == ["torch.save"], ckpt


def test_the_self_check_is_silent(epochs):
    assert epochs.summary["self_check"] == [], epochs.summary["self_check"]
    assert not epochs.step_detection_lines(), epochs.stderr_tail()


def test_the_run_end_table_shows_the_goodput_bar(epochs):
    lines = [ln for ln in epochs.stderr.splitlines() if ln.strip().startswith("goodput")]
    assert lines and "of the" in lines[0] and "wall time in train steps" in lines[0], epochs.stderr_tail()
    assert any("[" in ln and "#" in ln for ln in epochs.stderr.splitlines()), epochs.stderr_tail()
    assert "checkpoints: 3 saves" in epochs.stderr, epochs.stderr_tail()


def test_the_exported_metrics_agree_with_the_summary(epochs):
    job = epochs.summary["job"]
    points = {attrs["training.activity"]: value for attrs, value in epochs.points.get("training.job.time", [])}
    assert set(points) == {k for k, v in job["activities"].items() if v > 0}, points
    for activity, seconds in points.items():
        assert seconds == pytest.approx(job["activities"][activity], rel=1e-6, abs=1e-6), activity
    (goodput,) = [value for _, value in epochs.points["training.goodput"]]
    assert goodput == pytest.approx(job["goodput"], rel=1e-6)


def _torch_compile_s(times: dict) -> float:
    """torch's own counters: dynamo's compile of each frame, and backward graphs compiled
    at their first backward (the releases name the functions differently)."""
    frames = sum(v for k, v in times.items() if k.endswith("compile_inner"))
    backward = sum(v for k, v in times.items() if k.endswith("_backward_impl"))
    return frames + backward


def test_compile_time_matches_torchs_counters(compiled):
    truth = _torch_compile_s(compiled.truth["notes"]["compile_times"])
    assert truth > 0, compiled.truth["notes"]["compile_times"]
    got = compiled.summary["job"]["activities"]["compile"]
    assert abs(got - truth) <= COMPILE_TOLERANCE * truth, (got, truth, compiled.truth["notes"]["compile_times"])


def test_the_recompilation_is_placed_in_the_step_it_hit(compiled):
    comp = compiled.summary["job"]["compile"]
    assert comp["compilations"] >= 2 and comp["recompilations"] >= 1, comp
    assert {"mode": "eval", "step": 0} in [{k: r[k] for k in ("mode", "step")} for r in comp["recompiled_at"]], comp
    # compilation is no training: the first steps' compile time is not train time
    assert compiled.summary["job"]["activities"]["train"] < compiled.summary["modes"]["train"]["step_time_s"]
