"""Goodput: every second of the process in one activity (aggregate/job.py), the
checkpoint calls and compilations found zero-code (record/activities.py), the
instruments (export/job.py), the findings and the goodput bar (cli/job_*.py), and the
self-check that speaks only of time that is neither a step nor an activity."""

from __future__ import annotations

import io
import threading
import time
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import otel_training
from otel_training.aggregate.ideal_step import slow_steps
from otel_training.aggregate.job import JobClock
from otel_training.aggregate.run_model import Job, Run, RunFacts
from otel_training.diagnosis.evidence import RankJob
from otel_training.diagnosis.goodput_findings import job_findings
from otel_training.diagnosis.goodput_text import (
    bar,
    compare_job,
    goodput_lines,
    report_lines,
    summary_lines,
)
from otel_training.export import job as job_export
from otel_training.record.activities import (
    BACKWARD,
    CHECKPOINT,
    COMPILE,
    FIRST,
    LOAD,
    RECOMPILE,
    SAVE,
    UNKNOWN,
    ActivityLog,
    Interval,
    compile_op,
)
from tests.conftest import make_dataset, make_model

MS = 1_000_000


class Step(NamedTuple):  # the StepRecord fields the clock reads
    host: tuple
    mode: str
    number: int


class Named:  # a BetweenRecord's outermost phase
    def __init__(self, name: str, start: int, end: int) -> None:
        self.name, self.start, self.end = name, start * MS, end * MS


def step(start: int, end: int, mode: str = "train", number: int = 0) -> Step:
    return Step((start * MS, (start + end) * MS // 2, end * MS), mode, number)


def clock_with(*intervals: Interval, started: int = 0) -> JobClock:
    log = ActivityLog()
    for iv in intervals:
        log.add(iv)
    return JobClock(started * MS, log)


def ms(clock: JobClock) -> dict:
    return {k: round(v * 1000) for k, v in clock.totals().items() if v}


# -- the accounting ----------------------------------------------------------------------
def test_every_nanosecond_of_the_process_in_one_activity():
    c = clock_with()
    c.add([step(10, 20), step(20, 30, number=1)])
    c.add([step(40, 50, "eval")])  # the 10 ms before it: other (a step follows)
    c.end(70 * MS)
    c.finish()
    assert ms(c) == {"startup": 10, "train": 20, "other": 10, "eval": 10, "shutdown": 20}
    job = c.to_dict()
    assert job["wall_s"] == pytest.approx(0.070)
    assert job["goodput"] == pytest.approx(20 / 70)
    assert sum(job["activities"].values()) == pytest.approx(job["wall_s"])
    assert list(job["activities"])[:7] == ["startup", "compile", "train", "eval", "checkpoint", "other", "shutdown"]


def test_contiguous_batches_add_up_as_step_by_step():
    """The usual batch (one mode, no gap, no interval) is added in bulk; any other step
    by step: the totals are the same."""
    c = clock_with()
    c.add([step(10, 20)])
    c.add([step(20, 30, number=1), step(30, 40, number=2)])  # in bulk
    c.log.add(Interval(CHECKPOINT, 42 * MS, 44 * MS, "torch.save", SAVE))
    c.add([step(40, 50, number=3), step(50, 60, number=4)])  # an interval inside
    c.add([step(60, 70, "eval"), step(70, 80, number=5)])  # two modes
    c.add([step(80, 90, number=6), step(91, 95, number=7)])  # a gap
    assert ms(c) == {"startup": 10, "train": 72, "checkpoint": 2, "eval": 10, "other": 1}


def test_time_after_the_last_step_is_shutdown_and_becomes_other_when_a_step_follows():
    c = clock_with()
    c.add([step(10, 20)])
    c.add_between(Named("upload", 25, 30))
    assert "other" not in ms(c) and "shutdown" not in ms(c)  # the 5 ms before the upload: not final yet
    c.add([step(40, 50, number=1)])
    assert ms(c)["other"] == 15 and ms(c)["upload"] == 5
    c.end(60 * MS)
    c.finish()
    assert ms(c) == {"startup": 10, "train": 20, "upload": 5, "other": 15, "shutdown": 10}


def test_checkpoints_count_as_checkpoint_wherever_they_fall():
    c = clock_with(
        Interval(CHECKPOINT, 2 * MS, 4 * MS, "torch.load", LOAD),  # a resume, before the first step
        Interval(CHECKPOINT, 14 * MS, 16 * MS, "lightning.Trainer.save_checkpoint", SAVE),  # inside a step
        Interval(CHECKPOINT, 22 * MS, 27 * MS, "torch.save", SAVE),  # between steps
        Interval(CHECKPOINT, 52 * MS, 55 * MS, "torch.save", SAVE),  # after the last step
    )
    c.add([step(10, 20)])
    c.add([step(30, 50, number=1)])
    c.end(60 * MS)
    c.finish()
    assert ms(c) == {"startup": 8, "checkpoint": 12, "train": 28, "other": 5, "shutdown": 7}
    assert c.between_activity_ns() == 5 * MS  # (the self-check's accounted time: between steps only)
    job = c.to_dict()
    assert job["checkpoint"]["saves"] == 3 and job["checkpoint"]["loads"] == 1
    assert job["checkpoint"]["save_s"] == pytest.approx(0.010) and job["checkpoint"]["load_s"] == pytest.approx(0.002)
    assert {x["name"]: x["count"] for x in job["checkpoint"]["calls"]} == {
        "torch.save": 2, "torch.load": 1, "lightning.Trainer.save_checkpoint": 1}


def test_an_interval_across_two_ranges_is_split_between_them():
    c = clock_with(Interval(CHECKPOINT, 18 * MS, 24 * MS, "torch.save", SAVE))
    c.add([step(10, 20)])
    c.add([step(30, 40, number=1)])
    c.end(40 * MS)
    c.finish()
    assert ms(c) == {"startup": 10, "train": 18, "checkpoint": 6, "other": 6}


def test_named_phases_by_name_and_theirs_where_steps_ran_inside():
    c = clock_with(Interval(CHECKPOINT, 33 * MS, 35 * MS, "torch.save", SAVE))
    c.add_between(Named("build_index", 2, 6))  # before the first step: its name, not start-up
    c.add([step(10, 20)])
    c.add([step(24, 28, "eval"), step(29, 31, "eval", 1)])  # steps inside "validate" (below)
    c.add_between(Named("validate", 22, 32))
    c.add_between(Named("checkpoint", 32, 36))  # the user's name for it: the same activity
    c.add([step(40, 50, number=1)])
    c.end(50 * MS)
    c.finish()
    got = ms(c)
    assert got["build_index"] == 4 and got["startup"] == 6
    assert got["validate"] == 4  # 22-24, 28-29, 31-32: the time around its steps
    assert got["eval"] == 6
    assert got["checkpoint"] == 4  # the save (2) and the rest of the user's "checkpoint" (2)
    assert got["other"] == 2 + 4  # 20-22 and 36-40
    assert sum(got.values()) == 50
    assert c.to_dict()["named"] == ["build_index", "validate"]


def test_a_user_name_never_counts_as_training():
    c = clock_with()
    c.add([step(10, 20)])
    c.add_between(Named("train", 20, 30))
    c.add([step(30, 40, number=1)])
    assert ms(c)["train"] == 20 and ms(c)["train (named)"] == 10


def test_compilations_come_out_of_the_steps_and_recompilations_name_theirs():
    c = clock_with(
        Interval(COMPILE, 11 * MS, 17 * MS, "0/0", FIRST),
        Interval(COMPILE, 18 * MS, 19 * MS, "0/0", BACKWARD),
        Interval(COMPILE, 31 * MS, 34 * MS, "0/1", RECOMPILE),
    )
    c.add([step(10, 20), step(20, 30, number=1), step(30, 40, "eval")])
    c.end(40 * MS)
    c.finish()
    assert ms(c) == {"startup": 10, "compile": 10, "train": 13, "eval": 7}
    comp = c.to_dict()["compile"]
    assert comp["compilations"] == 3 and comp["recompilations"] == 1
    assert comp["recompiled_at"] == [{"mode": "eval", "step": 0, "count": 1, "s": pytest.approx(0.003)}]


def test_without_compile_ids_a_compilation_after_the_first_compiling_step_is_a_recompilation():
    c = clock_with(
        Interval(COMPILE, 11 * MS, 15 * MS, "", UNKNOWN),
        Interval(COMPILE, 16 * MS, 18 * MS, "", UNKNOWN),  # the same step: its backward
        Interval(COMPILE, 52 * MS, 55 * MS, "", UNKNOWN),
    )
    c.add([step(10, 20), step(50, 60, number=5)])
    c.finish()
    comp = c.to_dict()["compile"]
    assert comp["recompilations"] == 1
    assert [(r["mode"], r["step"]) for r in comp["recompiled_at"]] == [("train", 5)]


class _Trigger(NamedTuple):
    name: str


class _CallbackArgs(NamedTuple):  # torch 2.6 on: CallbackArgs
    callback_trigger: _Trigger
    compile_id: str


@pytest.mark.parametrize("args,want", [
    ((), ("", UNKNOWN)),  # torch before 2.6: no arguments
    ((_CallbackArgs(_Trigger("DYNAMO"), "0/0"),), ("0/0", FIRST)),
    ((_CallbackArgs(_Trigger("DYNAMO"), "2/3"),), ("2/3", RECOMPILE)),
    ((_CallbackArgs(_Trigger("LAZY_BACKWARD"), "0/0"),), ("0/0", BACKWARD)),
])
def test_compile_ids_of_every_torch_release(args, want):
    assert compile_op(args) == want


def test_the_ideal_step_time_and_the_slow_steps():
    normal = [0.100 + 0.001 * (i % 10) for i in range(98)]  # median 0.1045, MAD 0.0025: all under the bound
    durations = normal + [1.0, 2.0]
    ideal, lost, slow = slow_steps(durations, 100)
    assert ideal == pytest.approx(sum(normal) / 98)
    assert slow == 2 and lost == pytest.approx(3.0 - 2 * ideal)
    ideal2, lost2, slow2 = slow_steps(durations[::2], 100)  # thinned: scaled to the steps
    assert slow2 == 2 and lost2 == pytest.approx(2 * (1.0 - ideal2))  # (the 1.0 s step kept of the two)
    assert slow_steps(durations, 100, compile_s=2.5)[1] == pytest.approx(3.0 - 2 * ideal - 2.5)
    assert slow_steps([], 0) == (None, 0.0, 0)


def test_nothing_is_reported_before_the_first_step_and_counters_never_go_down():
    c = clock_with()
    observed = job_export._Observed()
    observed.use(c, {"host.name": "h"}, None)
    assert observed.time(None) == [] and observed.goodput(None) == []
    c.add([step(10, 20)])
    c.add([step(30, 40, number=1)])
    first = {p.attributes["training.activity"]: p.value for p in observed.time(None)}
    assert first == {"startup": pytest.approx(0.010), "train": pytest.approx(0.020), "other": pytest.approx(0.010)}
    assert all(p.attributes["host.name"] == "h" for p in observed.time(None))
    (g,) = observed.goodput(None)
    assert g.value == pytest.approx(0.5)
    c.add_between(Named("validate", 25, 45))  # claims the other time it held
    again = {p.attributes["training.activity"]: p.value for p in observed.time(None)}
    assert again["other"] == pytest.approx(0.010) and again["validate"] == pytest.approx(0.010)


# -- findings and the bar ------------------------------------------------------------------
def _run(**sections) -> Run:
    """A run summary with no steps and the sections given."""
    return Run.from_dict({"schema": "otel-training/summary/v1", "modes": {}, **sections})


def _job(**activities: float) -> dict:
    base = dict.fromkeys(("startup", "compile", "train", "eval", "checkpoint", "other", "shutdown"), 0.0)
    base.update(activities)
    wall = sum(base.values())
    return {"wall_s": wall, "goodput": base["train"] / wall, "activities": base, "named": [],
            "checkpoint": {"saves": 3, "save_s": base["checkpoint"], "loads": 0, "load_s": 0.0,
                           "calls": [{"name": "torch.save", "count": 3, "total_s": base["checkpoint"]}]},
            "compile": {"compilations": 0, "recompilations": 0, "recompiled_at": []}}


@pytest.mark.parametrize("activity,kind,advice", [
    ("checkpoint", "checkpoint_bound", "async_save"),
    ("startup", "startup_bound", "index or preprocess the data set"),
    ("eval", "eval_bound", "evaluate less often"),
    ("other", "other_bound", "otel_training.phase"),
])
def test_a_finding_for_each_activity_that_holds_the_wall_time(activity, kind, advice):
    job = Job.from_dict(_job(train=5.0, **{activity: 5.0}))
    found = job_findings(job)
    assert found[0].kind == kind and found[0].score == pytest.approx(0.5), found
    assert any(advice in a for a in found[0].advice), found[0].advice
    assert job_findings(Job.from_dict(_job(train=95.0, **{activity: 5.0}))) == []  # under every threshold


def test_start_up_advice_fits_what_the_run_does():
    """Compile caches only where the run compiled, spawned workers only where it has
    DataLoader workers (both kept where unknown), and a short run told so."""
    def advice(job, facts=None):
        found = job_findings(Job.from_dict(job), None, RunFacts.from_dict(facts) if facts is not None else None)
        (f,) = [f for f in found if f.kind == "startup_bound"]
        return " | ".join(f.advice)

    plain = _job(startup=300.0, train=700.0)
    no_workers = {"loaders": [{"num_workers": 0, "shuffle": True}]}
    text = advice(plain, no_workers)
    assert "TORCHINDUCTOR_CACHE_DIR" not in text and "spawned workers" not in text and "this short" not in text, text
    assert "index or preprocess" in text
    compiled = dict(_job(startup=250.0, compile=50.0, train=700.0),
                    compile={"compilations": 3, "recompilations": 1,
                             "recompiled_at": [{"mode": "train", "step": 12, "count": 1, "s": 0.5}]})
    assert "TORCHINDUCTOR_CACHE_DIR" in advice(compiled, no_workers)
    assert "spawned workers" in advice(plain, {"loaders": [{"num_workers": 4, "shuffle": True}]})
    eval_workers = {"loaders": [{"num_workers": 0, "shuffle": True}, {"num_workers": 2, "shuffle": False}]}
    assert "spawned workers" in advice(plain, eval_workers)  # an eval loader's workers start too
    unknown = advice({k: v for k, v in plain.items() if k != "compile"})
    assert "TORCHINDUCTOR_CACHE_DIR" in unknown and "spawned workers" in unknown
    assert advice(_job(startup=3.0, train=7.0), no_workers).startswith("a run this short (10 s)")
    # The run-end table reads the summary's run section; a report, its run_facts.
    table = "\n".join(summary_lines(_run(job=plain, run=no_workers)))
    assert "start-up-bound" in table and "spawned workers" not in table, table
    report = "\n".join(report_lines([RankJob(rank=0, job=Job.from_dict(plain))], (), RunFacts.from_dict(no_workers)))
    assert "start-up-bound" in report and "spawned workers" not in report, report


def test_the_goodput_bar_and_its_lines():
    data = _job(startup=4.6, train=0.73, eval=0.35, checkpoint=0.39, other=0.8, shutdown=0.43)
    job = Job.from_dict(data)
    b = bar(job)
    assert len(b) == 42 and b[1] == "S" and "#" in b and "E" in b and "K" in b and b[-2] == "s", b
    lines = goodput_lines(job)
    assert lines[0].startswith("  goodput: 10.0% of the 7.30 s wall time in train steps (0.73 s)"), lines
    assert "S startup 4.60 s 63%" in lines[2] and "checkpoints: 3 saves 0.39 s (torch.save)" in lines[3]
    table = summary_lines(_run(job=data))
    assert any(ln.startswith("goodput: start-up-bound") for ln in table), table
    cmp = compare_job([job], [Job.from_dict(_job(startup=1.0, train=6.0))])
    assert cmp is not None and cmp.goodput.delta == pytest.approx(6.0 / 7.0 - data["goodput"])


def test_a_job_section_per_process_from_prometheus_increases():
    deltas = {("i0", "h", "0", "train"): 30.0, ("i0", "h", "0", "startup"): 10.0, ("i0", "h", "0", "upload"): 10.0,
              ("i1", "h", "1", "train"): 45.0, ("i1", "h", "1", "other"): 5.0, ("i1", "h", "1", "eval"): 0.0}
    from otel_training.report.model import Report
    from otel_training.report.prometheus import jobs_from_deltas

    jobs = Report(source="prometheus", job=tuple(jobs_from_deltas(deltas))).jobs()
    assert [(j.rank, j.job.wall_s, j.job.goodput) for j in jobs] == [(0, 50.0, 0.6), (1, 50.0, 0.9)]
    assert jobs[0].job.named == ("upload",) and jobs[0].job.activities["upload"] == 10.0
    ranks = jobs
    assert "job goodput: 75.0% (mean over 2 ranks)" in "\n".join(report_lines(ranks))


# -- found without code changes: in a real loop ----------------------------------------------
class SlowDisk(io.BytesIO):
    """A file whose writes take time (a network filesystem)."""

    def write(self, b):
        time.sleep(0.02)
        return super().write(b)


class PtFiles(Dataset):
    """A data set stored as .pt files: its torch.load is data loading, not a checkpoint."""

    def __init__(self, blobs):
        self.blobs = blobs

    def __len__(self):
        return len(self.blobs)

    def __getitem__(self, i):
        x, y = torch.load(io.BytesIO(self.blobs[i]))
        return x, y


def _blobs(n: int) -> list:
    ds = make_dataset(n)
    out = []
    for i in range(n):
        buf = io.BytesIO()
        torch.save(ds[i], buf)
        out.append(buf.getvalue())
    return out


def test_torch_save_between_epochs_is_checkpoint_time_and_the_self_check_stays_silent(instrumented):
    blobs = _blobs(32)
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved, other = [], threading.Thread(target=lambda: torch.save(model.state_dict(), SlowDisk()))
    for _ in range(3):
        for x, y in DataLoader(PtFiles(blobs), batch_size=8):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        t0 = time.perf_counter()
        torch.save(model.state_dict(), SlowDisk())
        saved.append(time.perf_counter() - t0)
        time.sleep(0.3)  # a blocking upload: other time, no doubt about the steps
    other.start()  # a save on another thread: not the training thread's time
    other.join()
    loaded = torch.load(io.BytesIO(blobs[0]))  # on the training thread, no step open: a load
    assert isinstance(loaded, (list, tuple))
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    job = summary["job"]
    ckpt = job["checkpoint"]
    assert ckpt["saves"] == 3 and ckpt["loads"] == 1, ckpt  # the dataset's 96 loads are data loading
    assert ckpt["save_s"] == pytest.approx(sum(saved), rel=0.05, abs=0.005)
    assert job["activities"]["other"] >= 2 * 0.3 and job["activities"]["shutdown"] >= 0.3
    assert summary["self_check"] == []


def test_uninstrument_restores_every_function_exactly(instrumented):
    save, load = torch.save, torch.load
    tel = instrumented()
    assert torch.save is not save and torch.load is not load
    tel.uninstrument()
    assert torch.save is save and torch.load is load


def test_a_fault_in_our_bookkeeping_never_reaches_the_save_and_is_counted(instrumented, monkeypatch):
    tel = instrumented()

    def broken(self, interval):
        raise RuntimeError("planted")

    monkeypatch.setattr(ActivityLog, "add", broken)
    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf)
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()))["w"], torch.ones(3))
    monkeypatch.undo()
    tel.uninstrument()
    assert tel.runtime.telemetry.errors.get(CHECKPOINT, 0) >= 2


def test_the_users_exception_goes_through_and_the_next_save_still_counts(instrumented, tmp_path):
    missing = str(tmp_path / "missing" / "x.pt")
    with pytest.raises(Exception) as plain:  # noqa: B017 (whatever torch raises, unchanged)
        torch.save({"w": 1}, missing)
    tel = instrumented()
    with pytest.raises(type(plain.value)) as ours:
        torch.save({"w": 1}, missing)
    assert str(ours.value) == str(plain.value)
    torch.save({"w": 1}, str(tmp_path / "x.pt"))
    model = make_model()
    model(torch.randn(2, 8))  # a step: the job has a first step
    tel.uninstrument()
    assert tel.runtime.summary_dict()["job"]["checkpoint"]["saves"] == 2


def test_safetensors_and_distributed_checkpoint_are_found(instrumented, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    tel = instrumented()
    model = make_model()
    model(torch.randn(2, 8))
    safetensors.save_file(dict(model.state_dict()), str(tmp_path / "m.safetensors"))
    safetensors.load_file(str(tmp_path / "m.safetensors"))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    dcp.load({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    tel.uninstrument()
    calls = {c["name"]: c["count"] for c in tel.runtime.summary_dict()["job"]["checkpoint"]["calls"]}
    assert calls == {"safetensors.save_file": 1, "safetensors.load_file": 1,
                     "torch.distributed.checkpoint.save": 1, "torch.distributed.checkpoint.load": 1}, calls


def test_save_pretrained_and_from_pretrained_are_one_interval_each(instrumented, tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    tel = instrumented()
    config = BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=16)
    model = BertModel(config)
    model(torch.randint(0, 32, (1, 4)))
    model.save_pretrained(str(tmp_path / "bert"))  # safetensors (or torch.save) inside: one interval
    BertModel.from_pretrained(str(tmp_path / "bert"))
    tel.uninstrument()
    calls = {c["name"]: c["count"] for c in tel.runtime.summary_dict()["job"]["checkpoint"]["calls"]}
    assert calls == {"save_pretrained": 1, "from_pretrained": 1}, calls
    assert type(vars(transformers.modeling_utils.PreTrainedModel)["from_pretrained"]) is classmethod
    assert not getattr(vars(transformers.modeling_utils.PreTrainedModel)["from_pretrained"].__func__,
                       "_otel_patch", False)


def test_low_coverage_still_speaks_where_model_work_ran_outside_steps(instrumented):
    """A manual step() loop whose eval forwards run outside step(): steps do not cover
    the loop, and the model work outside them says so."""
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        for x, y in DataLoader(make_dataset(16), batch_size=8):
            with otel_training.step():
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        deadline = time.perf_counter() + 0.2
        with torch.no_grad():
            while time.perf_counter() < deadline:  # an eval loop the manual steps leave out
                model(torch.randn(64, 8))
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    assert [f["kind"] for f in summary["self_check"]] == ["low_coverage"], summary["self_check"]
    assert "model work ran outside steps" in summary["self_check"][0]["cause"]


def test_report_compare_and_the_html_page_show_the_goodput(instrumented, tmp_path, capsys):
    import json

    from otel_training.cli import main

    path = tmp_path / "run.json"
    tel = instrumented(summary_file=str(path))  # written at the end, with the run's time series
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(make_dataset(32), batch_size=8):
        F.cross_entropy(model(x), y).backward()
        opt.step()
    torch.save(model.state_dict(), SlowDisk())
    tel.uninstrument()
    assert main(["report", "--summary", str(path), "--html", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "goodput: " in out and "checkpoints: 1 save" in out, out
    page = (tmp_path / "r.html").read_text()
    assert "Goodput: the wall time by activity" in page and 'class="goodput"' in page
    assert main(["compare", str(path), str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["job"]["goodput"]["delta"] == 0.0
    assert main(["compare", str(path), str(path)]) == 0
    assert "goodput: A " in capsys.readouterr().out


def test_a_step_still_open_when_the_code_returned_ends_the_wall_time():
    c = clock_with()
    c.end(25 * MS)  # the main thread's code returned; its open step ends just after
    c.add([step(10, 30)])
    c.finish()
    job = c.to_dict()
    assert job["wall_s"] == pytest.approx(0.030) and sum(job["activities"].values()) == pytest.approx(0.030)


def test_a_fault_in_the_job_clock_is_contained_and_the_rest_of_the_summary_stays(instrumented, monkeypatch):
    def broken(self, *args):
        raise RuntimeError("planted")

    monkeypatch.setattr(JobClock, "add", broken)
    monkeypatch.setattr(JobClock, "add_between", broken)
    monkeypatch.setattr(JobClock, "to_dict", broken)
    tel = instrumented()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(make_dataset(32), batch_size=8):
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with otel_training.phase("upload"):
        time.sleep(0.01)
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    assert summary["modes"]["train"]["steps"] == 4 and "job" not in summary
    assert sum(tel.runtime.telemetry.errors.values()) >= 2
