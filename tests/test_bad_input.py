"""Bad input, as users meet it: real processes under
``opentelemetry-instrument python script.py``. Every malformed setting gets exactly one
line on stderr that names the variable and what it accepts -- never a traceback -- and
training goes on wherever the mistake is not fatal.

* a malformed ``OTEL_TRAINING_*`` value stops the run before it starts (status 2): a
  setting silently ignored for a whole training run is worse;
* a malformed OTLP endpoint turns export off (training and the summary go on);
* an unwritable ``OTEL_TRAINING_SUMMARY_FILE`` is reported at start (no second message
  at the end); a missing folder is created."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from otel_training.config import ConfigError, load_config, variables
from tests.scripts.harness import instrumented, otel_env, run

pytestmark = pytest.mark.slow

STEPS = "5"
CANDIDATES = ("definitely-not-valid", "-1", "1.5", "nan", "inf", "0", "maybe", "-0.5")


def _bad_value(var: str):
    for candidate in CANDIDATES:
        try:
            load_config({var: candidate})
        except ConfigError:
            return candidate
    return None  # accepts any string (a path)


ACCEPT_ANYTHING = [v for v in variables() if _bad_value(v) is None]


def _env(tmp_path, **extra):
    # No Collector: exporters off unless a test needs one (then a closed port), so that
    # stderr holds our lines only.
    settings = {"OTEL_TRAINING_HARDWARE": "false", "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    settings.update(extra)
    return otel_env("http://127.0.0.1:9", tmp_path, **settings)


@pytest.mark.parametrize("var", [v for v in variables() if v not in ACCEPT_ANYTHING])
def test_each_malformed_variable_stops_the_run_with_one_clear_line(var, tmp_path):
    bad = _bad_value(var)
    r = run(instrumented("train_loop.py", "--steps", STEPS), _env(tmp_path, **{var: bad}), timeout=60)
    lines = r.stderr_lines()
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith("otel-training: ") and f"{var}={bad!r}" in line, line
    assert "is not valid: use " in line, line  # ... and what is accepted
    assert r.proc.returncode == 2
    assert "TRAINING_START" not in r.stdout  # stopped before the user's code ran


def test_every_malformed_variable_is_named_in_the_one_line(tmp_path):
    """Three mistakes, one line naming all three (and what each accepts): not one per try."""
    bad = {"OTEL_TRAINING_GPU_TIMING": "gpu", "OTEL_TRAINING_TRACE_EVERY_N": "-1", "OTEL_TRAINING_MEMORY": "maybe"}
    r = run(instrumented("train_loop.py", "--steps", STEPS), _env(tmp_path, **bad), timeout=60)
    assert "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr_lines()
    assert r.proc.returncode == 2
    for var, value in bad.items():
        assert f"{var}={value!r} is not valid: use " in line, line
    assert "use one of auto, events, sync, off" in line and "use a whole number >= 0" in line
    assert "use true or false" in line
    with pytest.raises(ConfigError) as caught:
        load_config(bad)
    assert len(caught.value.problems) == 3


def test_the_config_command_shows_values_and_defaults_in_words(tmp_path):
    env = _env(tmp_path, OTEL_TRAINING_TRACE_EVERY_N="7")
    env.pop("OTEL_TRAINING_GPU_TIMING", None)
    env.pop("OTEL_TRAINING_TRACE_FILE", None)
    ok = subprocess.run(
        [sys.executable, "-m", "otel_training.cli", "config"], env=env, capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    lines = ok.stdout.splitlines()
    assert len(lines) == len(variables()), lines  # one line a variable, nothing after them
    rows = {line.split()[0]: line.split(None, 1)[1] for line in lines}
    assert rows["OTEL_TRAINING_TRACE_EVERY_N"] == "7"
    assert rows["OTEL_TRAINING_GPU_TIMING"] == "(default: auto)"
    assert rows["OTEL_TRAINING_TRACE_FILE"] == "(default: no trace file)"
    assert all(not v.startswith("(default: )") and "Config(" not in v for v in rows.values()), lines
    bad = subprocess.run(
        [sys.executable, "-m", "otel_training.cli", "config"],
        capture_output=True,
        text=True,
        env=dict(env, OTEL_TRAINING_GPU_TIMING="gpu", OTEL_TRAINING_MEMORY="maybe"),
        timeout=60,
    )
    assert bad.returncode == 2
    invalid = [line for line in bad.stdout.splitlines() if "INVALID" in line]
    assert len(invalid) == 2 and "use one of auto, events, sync, off" in invalid[0], invalid


def test_only_paths_accept_any_value():
    # (The attempts folder refuses a file that exists: tests/test_attempts.py.)
    assert ACCEPT_ANYTHING == [
        "OTEL_TRAINING_SUMMARY_FILE",
        "OTEL_TRAINING_TRACE_FILE",
        "OTEL_TRAINING_ATTEMPTS_DIR",
        "OTEL_TRAINING_PROFILE_DIR",
    ]


@pytest.mark.parametrize(
    "var, exporters, what",
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", ("otlp", "otlp"), "traces and metrics"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ("otlp", "none"), "traces"),
    ],
)
def test_a_malformed_endpoint_is_named_once_and_training_goes_on(var, exporters, what, tmp_path):
    summary = tmp_path / "summary.json"
    r = run(
        instrumented("train_loop.py", "--steps", STEPS),
        _env(
            tmp_path,
            **{
                var: "not a url",
                "OTEL_TRAINING_SUMMARY_FILE": str(summary),
                "OTEL_TRACES_EXPORTER": exporters[0],
                "OTEL_METRICS_EXPORTER": exporters[1],
            },
        ),
        timeout=120,
    )
    assert r.proc.returncode == 0, r.stderr
    assert r.marker("TRAINING_END")[2] == STEPS
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr_lines()
    assert len(lines) == 1, lines  # nothing else: no exporter error at every export
    assert lines[0].startswith(f"otel-training: {var}='not a url' is not valid: use a URL such as http"), lines
    assert f"({what} will not be exported; training continues)" in lines[0]
    assert json.loads(summary.read_text())["modes"]["train"]["steps"] == int(STEPS)


@pytest.mark.parametrize("target", ["under-a-file", "a-directory"])
def test_an_unwritable_summary_file_is_named_once_and_training_goes_on(target, tmp_path):
    blocker = tmp_path / "blocker"
    if target == "under-a-file":
        blocker.write_text("a file, not a folder")
        path = blocker / "summary.json"
    else:
        blocker.mkdir()
        path = blocker
    r = run(
        instrumented("train_loop.py", "--steps", STEPS),
        _env(tmp_path, OTEL_TRAINING_SUMMARY_FILE=str(path)),
        timeout=120,
    )
    assert r.proc.returncode == 0, r.stderr
    assert r.marker("TRAINING_END")[2] == STEPS
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr_lines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"otel-training: OTEL_TRAINING_SUMMARY_FILE={str(path)!r} cannot be written (")
    assert "use a writable file path" in lines[0]


def test_a_missing_summary_folder_is_created(tmp_path):
    path = tmp_path / "not" / "there" / "summary-{rank}.json"
    r = run(
        instrumented("train_loop.py", "--steps", STEPS),
        _env(tmp_path, OTEL_TRAINING_SUMMARY_FILE=str(path)),
        timeout=120,
    )
    assert r.proc.returncode == 0, r.stderr
    assert r.stderr_lines() == []
    written = json.loads((tmp_path / "not" / "there" / "summary-0.json").read_text())
    assert written["modes"]["train"]["steps"] == int(STEPS)
