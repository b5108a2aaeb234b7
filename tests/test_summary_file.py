"""The summary file as a contract: files written before the run model was typed
(tests/golden/summary_v1_*.json, from real runs) are read and written back byte for
byte, ``report`` reads them, the shipped JSON Schema is the model's, a wrong-typed
key is refused by name, and output into a closed pipe ends quietly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from otel_training.aggregate.run_model import SCHEMA, SCHEMA_FILE, Run, SummaryError, json_schema
from otel_training.cli.report import main as report_main

ROOT = Path(__file__).resolve().parents[1]
# single: train and eval steps, a FLOP count, tokens, memory creep, checkpoints, the
# time series; restarted_rank1: rank 1 of 2, the second attempt of a restarted run.
GOLDEN = sorted((ROOT / "tests" / "golden").glob("summary_v1_*.json"))


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_a_v1_file_is_written_back_byte_for_byte(path):
    text = path.read_text(encoding="utf-8")
    run = Run.from_json(text)
    assert run.to_json() == text
    assert Run.from_dict(json.loads(text)).to_dict() == json.loads(text)


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_report_and_compare_read_a_v1_file(path, capsys):
    assert report_main(["--summary", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    data = json.loads(path.read_text())
    assert report["modes"]["train"]["steps"] == data["modes"]["train"]["steps"]
    from otel_training.cli.compare import main as compare_main

    assert compare_main([str(path), str(path)]) in (0, 1)
    assert "otel-training compare" in capsys.readouterr().out


def _two_ranks(directory: Path) -> str:
    """The single run's file as rank 0 of 2, and a rank 1 whose steps and phases take
    1.3 times as long (tests/golden/report_v1_two_ranks.json was made from these)."""
    single = json.loads((ROOT / "tests" / "golden" / "summary_v1_single.json").read_text())
    r0, r1 = json.loads(json.dumps(single)), json.loads(json.dumps(single))
    r0["world_size"] = 2
    r1.update(rank=1, pid=(single.get("pid") or 1) + 1, world_size=2)
    for m in r1["modes"].values():
        m["step_time_s"] *= 1.3
        for p in m["phases"]:
            p["total_s"] *= 1.3
            p["mean_s"] *= 1.3
    for name, data in (("r0.json", r0), ("r1.json", r1)):
        with open(directory / name, "w") as fh:
            json.dump(data, fh)
    return "r0.json,r1.json"


@pytest.mark.parametrize("name", ["single", "restarted_rank1", "two_ranks"])
def test_report_json_is_as_before_byte_for_byte(name, tmp_path, monkeypatch, capsys):
    """``report --json`` from the typed report prints what the report dict printed
    (tests/golden/report_v1_*.json: the same files reported before the report was typed)."""
    if name == "two_ranks":
        files = _two_ranks(tmp_path)
    else:
        files = f"summary_v1_{name}.json"
        (tmp_path / files).write_bytes((ROOT / "tests" / "golden" / files).read_bytes())
    monkeypatch.chdir(tmp_path)  # the file names as given are in the output
    assert report_main(["--summary", files, "--json"]) == 0
    assert capsys.readouterr().out == (ROOT / "tests" / "golden" / f"report_v1_{name}.json").read_text()


def test_compare_json_is_as_before_byte_for_byte(tmp_path, monkeypatch, capsys):
    """``compare --json --fail-on-regression`` from the typed comparison prints what the
    comparison dict printed (tests/golden/compare_v1_single_vs_slower.json: the single
    run against its rank 1 whose steps take 1.3 times as long, compared before it was typed)."""
    from otel_training.cli.compare import main as compare_main

    _two_ranks(tmp_path)
    single = "summary_v1_single.json"
    (tmp_path / single).write_bytes((ROOT / "tests" / "golden" / single).read_bytes())
    monkeypatch.chdir(tmp_path)
    assert compare_main([single, "r1.json", "--json", "--fail-on-regression", "10"]) == 0
    want = (ROOT / "tests" / "golden" / "compare_v1_single_vs_slower.json").read_text()
    assert capsys.readouterr().out == want


def test_the_model_reads_the_golden_sections():
    single, restarted = (Run.from_json(p.read_text()) for p in GOLDEN[::-1])
    train = single.modes["train"]
    assert single.schema == SCHEMA and train.flops is not None and train.flops.source == "measured"
    assert single.memory is not None and single.memory.creep is not None and single.timeseries
    assert single.run is not None and single.run.optimizers[0].class_name == "AdamW"
    assert restarted.rank == 1 and restarted.job is not None and restarted.job.attempt is not None
    assert restarted.job.attempt.number == 1 and restarted.job.run is not None and restarted.job.run.attempts == 2


def test_an_early_file_without_the_later_keys_is_read():
    """The first version's keys only (no timed_steps, tokens, coverage, job...)."""
    early = {
        "schema": SCHEMA, "service": "s", "run_id": "r", "host": "h", "rank": 0, "world_size": 1, "pid": 1,
        "timing": "off", "started_at": 1.0, "ended_at": 2.0,
        "modes": {"train": {"steps": 3, "samples": 24, "step_time_s": 0.3, "wall_s": 0.31, "step_mean_s": 0.1,
                            "step_p50_s": 0.1, "step_p90_s": 0.1, "step_max_s": 0.1,
                            "phases": [{"name": "forward", "parent": "step", "total_s": 0.1, "mean_s": 0.033,
                                        "count": 3, "share": 0.33}],
                            "gpu_idle_s": {}}},
        "telemetry": {"spans_dropped": 0, "steps_dropped": 0, "export_failures": 0, "errors": 0},
    }
    run = Run.from_dict(early)
    assert run.modes["train"].timed_steps is None and run.coverage is None and run.job is None
    assert run.to_dict() == early


def test_the_shipped_schema_is_the_models():
    shipped = ROOT / "otel_training" / "aggregate" / SCHEMA_FILE
    assert shipped.read_text() == json.dumps(json_schema(), indent=2) + "\n"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"otel_training.aggregate" = ["summary.schema.json"]' in pyproject


def test_the_docs_page_names_every_key():
    page = (ROOT / "docs" / "summary-file.md").read_text()
    schema = json_schema()
    missing = []
    for where in [schema, *schema["$defs"].values()]:
        missing += [k for k in where["properties"] if f"`{k}`" not in page]
    assert not missing, missing


def test_a_wrong_typed_key_is_refused_naming_the_file_and_key(tmp_path, capsys):
    data = json.loads(GOLDEN[-1].read_text())
    data["modes"]["train"]["steps"] = "twelve"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(SummaryError) as e:
        Run.from_dict(data)
    assert e.value.key == "modes.train.steps"
    code = report_main(["--summary", str(bad)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert str(bad) in err and "'modes.train.steps'" in err and "must be an integer" in err
    data = json.loads(GOLDEN[0].read_text())
    data["job"]["attempt"]["number"] = 1.5
    bad.write_text(json.dumps(data))
    from otel_training.cli.compare import main as compare_main

    assert compare_main([str(bad), str(GOLDEN[0])]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "'job.attempt.number'" in err and "Traceback" not in err


def test_output_into_a_closed_pipe_ends_quietly():
    """``otel-training report --summary F | head -1``: no BrokenPipeError traceback."""
    cmd = [sys.executable, "-m", "otel_training.cli", "report", "--summary", str(GOLDEN[-1])]
    for _ in range(3):  # the reader may close before or after the first write
        report = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
        head = subprocess.run(["head", "-c", "10"], stdin=report.stdout, capture_output=True, timeout=60)
        report.stdout.close()
        err = report.stderr.read().decode()
        report.stderr.close()
        status = report.wait(timeout=60)
        assert head.stdout == b"otel-train"
        assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
        assert status in (0, 141), (status, err)
