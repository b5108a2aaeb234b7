"""Named time between steps: the user's ``phase(name)`` with no step open (a checkpoint
between epochs, a save after the last step) is kept -- listed by coverage, a span of
its own under no step, trace-file events, ``training.phase.duration`` points with
``training.mode="between_steps"`` -- and the self-check never fires for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import otel_training
from tests.conftest import make_dataset, make_model, spin, train_step
from tests.otlp_receiver import OTLPReceiver, attributes

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PLANT = 0.3  # seconds of each planted checkpoint: large against a loaded machine's noise


def _epochs(checkpoint, save, epochs: int = 2) -> None:
    """Train epochs with an eval pass and ``checkpoint()`` after each, ``save()`` after
    the last step: the README's loop shape."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(make_dataset(48), batch_size=8)
    val = DataLoader(make_dataset(16), batch_size=8)
    for _ in range(epochs):
        model.train()
        for batch in train:
            train_step(model, opt, batch)
        model.eval()
        with torch.no_grad():
            for x, _y in val:
                model(x)
        checkpoint()
    save()


def test_checkpoint_between_epochs_and_save_after_the_last_step(instrumented, tmp_path):
    tel = instrumented(trace_file=str(tmp_path / "trace.json"))
    slept: dict[str, list[float]] = {"checkpoint": [], "write": [], "save": []}

    def checkpoint():
        with otel_training.phase("checkpoint"):
            slept["checkpoint"].append(spin(PLANT))
            with otel_training.phase("write"):  # nested: a child of the checkpoint
                slept["write"].append(spin(PLANT / 3))

    @otel_training.phase("save")  # the decorator form, after the last step
    def save():
        slept["save"].append(spin(PLANT))

    _epochs(checkpoint, save)
    tel.uninstrument()
    planted = {name: sum(v) for name, v in slept.items()}
    planted["checkpoint"] += planted["write"]

    # coverage lists the named time (the outermost phases) by name, and accounts for it
    summary = tel.runtime.summary_dict()
    assert summary["self_check"] == []
    cov = summary["coverage"]
    named = {n["name"]: n for n in cov["named"]}
    assert set(named) == {"checkpoint", "save"}
    assert named["checkpoint"]["count"] == 2 and named["save"]["count"] == 1
    for name in named:
        assert planted[name] <= named[name]["total_s"] <= planted[name] + 0.25, (name, named[name])
    assert cov["named_s"] >= planted["checkpoint"] + planted["save"]
    # the save after the last step lies inside the loop: the loop ends after it
    assert cov["loop_s"] >= cov["named_s"] + cov["in_steps_s"]
    assert cov["outside_s"] < 0.5 * PLANT, cov
    assert summary["modes"]["train"]["steps"] == 12 and summary["modes"]["eval"]["steps"] == 4

    # a root span of its own (under no step), its nested phase under it
    steps = tel.spans("step")
    step_traces = {s.context.trace_id for s in steps}
    spans = tel.spans("checkpoint")
    assert len(spans) == 2
    for span, took in zip(sorted(spans, key=lambda s: s.start_time), slept["checkpoint"]):
        assert span.parent is None and span.context.trace_id not in step_traces
        assert span.attributes["training.mode"] == "between_steps"
        assert (span.end_time - span.start_time) / 1e9 >= took
        for step in steps:  # no step span holds it
            assert step.end_time <= span.start_time or step.start_time >= span.end_time
    writes = tel.spans("write")
    assert len(writes) == 2
    assert {w.parent.span_id for w in writes} == {s.context.span_id for s in spans}
    (save_span,) = tel.spans("save")
    assert save_span.parent is None and save_span.start_time >= max(s.end_time for s in steps)

    # training.phase.duration points, training.mode="between_steps"; never a step's phase
    totals = tel.phase_totals("between_steps", mode="between_steps")
    assert set(totals) == {"checkpoint", "save"}
    assert planted["checkpoint"] <= totals["checkpoint"] <= planted["checkpoint"] + 0.25
    assert tel.phase_totals("checkpoint", mode="between_steps").keys() == {"write"}
    assert not {"checkpoint", "save", "write"} & {
        p.attributes["training.phase"]
        for p in tel.points("training.phase.duration")
        if p.attributes["training.mode"] != "between_steps"
    }

    # the trace file: one event per named phase, category between_steps
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    between = [e for e in events if e.get("cat") == "between_steps"]
    assert sorted(e["name"] for e in between) == ["checkpoint", "checkpoint", "save", "write", "write"]
    for e in between:
        if e["name"] == "save":
            assert e["dur"] / 1e6 >= slept["save"][0]


def test_between_manual_steps_and_an_error_inside(instrumented):
    """Between the user's own ``step()`` blocks, too; a phase that raises keeps its
    time, its span says so, and the error reaches the user."""
    tel = instrumented()
    for i in range(4):
        with otel_training.step():
            spin(0.01)
        if i == 1:
            with otel_training.phase("log"):
                spin(PLANT)
    with pytest.raises(OSError, match="disk full"):
        with otel_training.phase("save"):
            spin(PLANT / 3)
            raise OSError("disk full")
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    assert summary["self_check"] == []
    named = {n["name"]: n for n in summary["coverage"]["named"]}
    assert named["log"]["count"] == 1 and named["log"]["total_s"] >= PLANT
    assert named["save"]["total_s"] >= PLANT / 3
    (save,) = tel.spans("save")
    assert save.status.status_code.name == "ERROR"
    assert [e.name for e in save.events] == ["exception"]


def test_a_wrapper_around_the_eval_loop_keeps_its_steps(instrumented):
    """A named phase that holds steps (``with phase("validate"): for batch in val``): the
    steps are steps, the time between them is named, not outside."""
    tel = instrumented()
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in DataLoader(make_dataset(16), batch_size=8):
        train_step(model, opt, batch)
    with otel_training.phase("validate"):
        spin(PLANT)
        with torch.no_grad():
            for x, _y in DataLoader(make_dataset(16), batch_size=8):
                model(x)
        spin(PLANT)
    for batch in DataLoader(make_dataset(16), batch_size=8):
        train_step(model, opt, batch)
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    assert summary["modes"]["eval"]["steps"] == 2
    assert summary["self_check"] == []
    cov = summary["coverage"]
    assert cov["named_s"] >= 2 * PLANT and cov["outside_s"] < 0.5 * PLANT, cov


SCRIPT = """
import time
import torch
from torch.utils.data import DataLoader, TensorDataset
import otel_training

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
train = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), batch_size=8)
val = DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,))), batch_size=8)


@otel_training.phase("checkpoint")
def save(path):
    time.sleep(PLANT)
    torch.save(model.state_dict(), path)


for epoch in range(2):
    model.train()
    for x, y in train:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        for x, y in val:
            model(x)
    save(f"ckpt-{epoch}.pt")
with otel_training.phase("export"):  # after the last step: counted before exit's flush
    time.sleep(PLANT)
print("done")
"""


@pytest.mark.slow
def test_unmodified_script_under_opentelemetry_instrument(tmp_path):
    """The README's decorator between epochs and a phase after the last step, over
    real OTLP: root spans, the summary file, the run-end table, a silent self-check."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("PLANT", repr(PLANT)))
    with OTLPReceiver() as receiver:
        env = dict(
            os.environ,
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_EXPORTER_OTLP_INSECURE="true",
            OTEL_PYTHON_DISTRO="otel_training",
            OTEL_PYTHON_CONFIGURATOR="otel_training",
            OTEL_TRAINING_HARDWARE="false",
            OTEL_TRAINING_SUMMARY="true",
            OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "s.json"),
            OTEL_TRAINING_TRACE_FILE=str(tmp_path / "t.json"),
        )
        proc = subprocess.run(
            [str(BIN / "opentelemetry-instrument"), sys.executable, str(script)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
        receiver.wait_for(
            lambda r: (
                sum(s.name == "checkpoint" for _, s in r.spans()) == 2 and any(s.name == "export" for _, s in r.spans())
            )
        )
        spans = [s for _, s in receiver.spans() if s.name in ("checkpoint", "export")]
    assert "step detection in doubt" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "in named phases between steps (checkpoint 2 × " in proc.stderr, proc.stderr
    for span in spans:
        assert not span.parent_span_id
        assert attributes(span.attributes)["training.mode"] == "between_steps"
        assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 >= PLANT
    summary = json.loads((tmp_path / "s.json").read_text())
    named = {n["name"]: n for n in summary["coverage"]["named"]}
    assert named["checkpoint"]["count"] == 2 and named["checkpoint"]["total_s"] >= 2 * PLANT
    assert named["export"]["count"] == 1 and named["export"]["total_s"] >= PLANT
    assert summary["self_check"] == []
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sorted(e["name"] for e in trace if e.get("cat") == "between_steps") == ["checkpoint", "checkpoint", "export"]


def test_named_time_behind_a_held_step_reaches_the_pipeline_in_time_order(instrumented):
    """Gradient accumulation across the epoch's end: the assembler still holds the last
    backward pass when the checkpoint runs; the named time waits for the step that
    began before it, which then holds it (its time is not counted twice)."""
    tel = instrumented()
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    pipeline = tel.runtime.pipeline
    submit, submit_between = pipeline.submit, pipeline.submit_between
    pipeline_submit = lambda step: (seen.append(("step", step.marks[0])), submit(step))  # noqa: E731
    tel.tracker.assembler._sink = pipeline_submit
    tel.tracker.assembler.between_sink = lambda g: (seen.append(("named", g.times[0])), submit_between(g))
    loader = DataLoader(make_dataset(32), batch_size=8)  # 4 batches an epoch, an update every 3
    i = 0
    for _ in range(2):
        for x, y in loader:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            i += 1
            if i % 3 == 0:
                opt.step()
                opt.zero_grad()
        with otel_training.phase("checkpoint"):
            spin(PLANT / 3)
    tel.uninstrument()
    assert [kind for kind, _ in seen].count("named") == 2
    assert [t for _, t in seen] == sorted(t for _, t in seen)  # handed on in time order
    summary = tel.runtime.summary_dict()
    assert {n["name"]: n["count"] for n in summary["coverage"]["named"]} == {"checkpoint": 2}
    assert summary["telemetry"]["errors"] == 0
    cov = summary["coverage"]
    assert cov["in_steps_s"] + cov["named_s"] + cov["outside_s"] == pytest.approx(cov["loop_s"], abs=1e-6)
