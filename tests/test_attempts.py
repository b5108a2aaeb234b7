"""A restarted run: restart time and lost progress across attempts.

End to end, real processes: ``torchrun --max-restarts=1`` restarting a plain loop
that fails once (restart time, its metric, the attempt records), and an HF
``Trainer`` and a Lightning run that fail after a checkpoint and are run again,
resuming from it (the global steps redone and their train time against the script's
own clock). The attempt file's rules and the run's accounting are checked on real
files."""

from __future__ import annotations

import json
import os
import time

import pytest

from otel_training import semconv as sc
from otel_training.config import ConfigError, load_config
from otel_training.diagnosis.goodput_findings import job_findings
from otel_training.aggregate.run_model import Job
from otel_training.diagnosis.evidence import RankJob
from otel_training.diagnosis.goodput_text import compare_job, goodput_lines, report_lines
from otel_training.export import job as job_export
from otel_training.runtime.attempts import AttemptFile, attempt_file, lost_progress, prune, run_view
from tests.otlp_receiver import OTLPReceiver, attributes, free_port
from tests.scripts.harness import BIN, ROOT, SCRIPTS, otel_env, run

TOLERANCE = 0.15


def _attempt(**fields) -> dict:
    base = {"restart_count": None, "started_unix": 100.0, "ended_unix": 110.0, "final": True, "wall_s": 10.0,
            "activities": {"startup": 2.0, "train": 7.0, "checkpoint": 1.0}, "train_s": 7.0, "restart_s": 0.0,
            "lost_progress_s": 0.0, "lost_steps": 0, "resumed_at": None, "global_step": None, "saves": []}
    base.update(fields)
    return base


def _file(tmp_path, attempts: list, run_id: str = "r") -> None:
    path = tmp_path / run_id / "rank-0.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run_id": run_id, "rank": 0, "attempts": attempts}))


# -- which earlier attempts a process links to -------------------------------------------
def test_torchrun_restart_count_decides_what_is_a_restart(tmp_path):
    _file(tmp_path, [_attempt(restart_count=0)], "none")
    assert AttemptFile(str(tmp_path), "none", 0, 0).load() == []  # a new run of the same id
    linked = AttemptFile(str(tmp_path), "none", 0, 1)
    assert len(linked.load()) == 1 and linked.number == 1
    _file(tmp_path, [_attempt(restart_count=2)], "none")  # left by another run of id "none"
    assert AttemptFile(str(tmp_path), "none", 0, 1).load() == []
    assert AttemptFile(str(tmp_path), "none", 1, 1).load() == []  # another rank's file: none


def test_a_run_id_the_user_set_links_reruns_and_a_made_up_one_keeps_nothing(tmp_path):
    _file(tmp_path, [_attempt(), _attempt()], "mine")
    f = attempt_file(str(tmp_path), "mine", 0, {"OTEL_TRAINING_RUN_ID": "mine"}, child=False)
    assert f is not None and len(f.load()) == 2 and f.number == 2
    assert attempt_file(str(tmp_path), "3f2a", 0, {}) is None
    # mp.spawn's ranks (multiprocessing children) share the id and, without RANK, rank 0.
    assert attempt_file(str(tmp_path), "mine", 0, {"OTEL_TRAINING_RUN_ID": "mine"}, child=True) is None
    assert attempt_file(str(tmp_path), "mine", 1, {"OTEL_TRAINING_RUN_ID": "mine", "RANK": "1"}, child=True)
    assert attempt_file("", "mine", 0, {"OTEL_TRAINING_RUN_ID": "mine"}) is None  # =none
    torchrun = attempt_file(None, "none", 3, {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert torchrun is not None and torchrun.restart_count == 2 and torchrun.path.name == "rank-3.json"


def test_an_unreadable_or_foreign_file_is_no_earlier_attempt(tmp_path):
    path = tmp_path / "r" / "rank-0.json"
    path.parent.mkdir(parents=True)
    for text in ("{not json", json.dumps({"run_id": "other", "attempts": [_attempt()]}), json.dumps([1, 2])):
        path.write_text(text)
        assert AttemptFile(str(tmp_path), "r", 0, None).load() == []


def _run_folder(root, name: str, age_s: float, files=("rank-0.json", "rank-1.json")):
    folder = root / name
    folder.mkdir(parents=True)
    when = time.time() - age_s
    for f in files:
        (folder / f).write_text("{}")
        os.utime(folder / f, (when, when))
    os.utime(folder, (when, when))
    return folder


def test_old_run_folders_are_pruned_and_nothing_else(tmp_path):
    """A week untouched: gone. A recent run, this run's own folder, a folder holding a
    file that is not ours, a folder just made, a link: kept."""
    week = 7 * 86_400
    old = _run_folder(tmp_path, "old", week + 3_600)
    recent = _run_folder(tmp_path, "recent", week - 3_600)
    mine = _run_folder(tmp_path, "mine", week + 3_600)
    foreign = _run_folder(tmp_path, "foreign", week + 3_600, files=("rank-0.json", "notes.txt"))
    (tmp_path / "new").mkdir()
    link = tmp_path / "link"
    link.symlink_to(_run_folder(tmp_path / "elsewhere", "target", week + 3_600), target_is_directory=True)
    assert prune(tmp_path, keep=mine) == 1
    assert not old.exists() and recent.exists() and mine.exists() and foreign.exists() and (tmp_path / "new").exists()
    assert link.exists() and (link / "rank-0.json").exists()
    assert prune(tmp_path / "missing", keep=mine) == 0


def test_a_run_prunes_old_run_folders_at_start(tmp_path):
    """A real run with a run id of its own removes a week-old run's folder beside its own."""
    old = _run_folder(tmp_path / "attempts", "last-month", 30 * 86_400)
    env = otel_env(None, tmp_path, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                   OTEL_LOGS_EXPORTER="none", OTEL_TRAINING_HARDWARE="false", OTEL_TRAINING_RUN_ID="today")
    r = run([str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(SCRIPTS / "train_restarted.py"),
             "--dir", str(tmp_path), "--steps", "6", "--step-ms", "10"], env, timeout=240)
    assert r.proc.returncode == 0, r.stderr
    assert not old.exists() and (tmp_path / "attempts" / "today" / "rank-0.json").exists()


def test_the_folder_variable_names_itself_when_malformed(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError) as e:
        load_config({"OTEL_TRAINING_ATTEMPTS_DIR": str(tmp_path / "f")})
    assert "OTEL_TRAINING_ATTEMPTS_DIR" in str(e.value) and "folder" in str(e.value)
    assert load_config({"OTEL_TRAINING_ATTEMPTS_DIR": "none"}).attempts_dir == ""
    assert load_config({"OTEL_TRAINING_ATTEMPTS_DIR": str(tmp_path)}).attempts_dir == str(tmp_path)


# -- lost progress and the run over its attempts ----------------------------------------
def test_lost_progress_is_the_train_time_after_the_save_it_resumed_from():
    prev = _attempt(train_s=7.0, global_step=30, resumed_at=0, saves=[[10, 2.0], [20, 4.5]])
    assert lost_progress(prev, 20) == (10, pytest.approx(2.5))
    assert lost_progress(prev, 30) == (0, 0.0)  # resumed from its last step: nothing lost
    assert lost_progress(prev, None) == (0, 0.0)  # no framework told a global step
    # It had resumed at 20 itself and saved nothing: all of its train time is redone.
    assert lost_progress(_attempt(train_s=3.0, global_step=25, resumed_at=20), 20) == (5, pytest.approx(3.0))
    # No save at the step: its pace (7 s for 30 steps) times the 15 steps.
    assert lost_progress(_attempt(train_s=7.0, global_step=30, resumed_at=0), 15) == (15, pytest.approx(3.5))


def test_every_second_of_the_run_is_in_one_activity():
    first = _attempt(wall_s=12.0, activities={"startup": 2.0, "train": 7.0}, final=False)  # killed: 3 s tail
    second = _attempt(restart_s=4.0, lost_progress_s=2.5, lost_steps=10)
    view = run_view([first, second])
    assert view["wall_s"] == pytest.approx(12 + 10 + 4)
    assert sum(view["activities"].values()) == pytest.approx(view["wall_s"])
    assert view["activities"]["restart"] == 4.0 and view["activities"]["lost_progress"] == 2.5
    assert view["activities"]["train"] == pytest.approx(14 - 2.5)
    assert view["goodput"] == pytest.approx(11.5 / 26)
    data = {"wall_s": 10.0, "goodput": 0.7, "activities": second["activities"], "run": view,
            "attempt": {"number": 1, "restart_s": 4.0, "lost_progress_s": 2.5, "lost_steps": 10,
                        "resumed_at_step": 20, "previous_exit": "recorded"}}
    job = Job.from_dict(data)
    text = "\n".join(goodput_lines(job))
    assert "attempt 2 of this run began 4.00 s after attempt 1 ended" in text
    assert "10 steps of attempt 1 (2.50 s of train time) done again" in text
    assert "run goodput over 2 attempts: 44.2%" in text and "R restart" in text and "x lost_progress" in text
    assert any(f.kind == "restart_bound" for f in job_findings(job))
    # report: the job's goodput is the mean over ranks of each rank's run goodput.
    other = Job.from_dict({"wall_s": 10.0, "goodput": 0.5, "activities": {"train": 5.0}})
    ranks = [RankJob(rank=0, job=job), RankJob(rank=1, job=other)]
    assert any(line.startswith("job goodput: 47.1% (mean over 2 ranks, over the run's attempts)")
               for line in report_lines(ranks))
    # compare: a restarted run's goodput and activities over its attempts.
    c = compare_job([job], [other])
    assert c is not None and c.goodput.a == pytest.approx(11.5 / 26) and c.wall_s.a == pytest.approx(26)
    assert {a.name: a.a for a in c.activities}["restart"] == 4.0


def test_a_first_attempt_has_no_restart_finding():
    job = Job.from_dict({"wall_s": 10.0, "goodput": 0.7, "activities": {"startup": 2.0, "train": 7.0, "other": 1.0}})
    assert not any(f.kind == "restart_bound" for f in job_findings(job))
    assert not any("restart" in line for line in goodput_lines(job))


def test_the_restart_is_exported_as_job_time_and_kept_out_of_the_process_goodput():
    from otel_training.aggregate.job import JobClock
    from otel_training.record.activities import ActivityLog

    class Step:
        def __init__(self, start, end):
            self.host, self.mode, self.number = [start, end], "train", 0

    c = JobClock(0, ActivityLog())
    c.restart_s = 3.0
    observed = job_export._Observed()
    observed.use(c, {}, None)
    c.add([Step(10, 20)])
    points = {p.attributes["training.activity"]: p.value for p in observed.time(None)}
    assert points["restart"] == 3.0 and points["train"] == pytest.approx(1e-8)
    (g,) = observed.goodput(None)
    assert g.value == pytest.approx(0.5)


# -- torchrun --max-restarts --------------------------------------------------------------
def _points(receiver, name: str) -> list:
    out = []
    for res, m in receiver.metrics():
        if m.name == name:
            data = m.sum if m.WhichOneof("data") == "sum" else m.gauge
            for p in data.data_points:
                attrs = attributes(p.attributes)
                out.append((res, attrs, p.as_double))
    return out


@pytest.mark.slow
def test_torchrun_max_restarts_counts_the_restart_on_every_rank(tmp_path, capsys):
    """Rank 1 fails at step 25; rank 0 waits there until torchrun stops it (SIGTERM);
    both restart, resume from their step-20 checkpoints and finish."""
    with OTLPReceiver() as receiver:
        env = otel_env(receiver.endpoint, tmp_path, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none",
                       OTEL_LOGS_EXPORTER="none", OTEL_TRAINING_HARDWARE="false", OTEL_TRAINING_SUMMARY="true",
                       OTEL_METRIC_EXPORT_INTERVAL="60000", GLOO_SOCKET_IFNAME="lo",
                       OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "summary-{rank}-{pid}.json"))
        cmd = [str(BIN / "torchrun"), "--nnodes=1", "--nproc_per_node=2", "--max-restarts=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--no-python",
               str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(SCRIPTS / "train_restarted.py"),
               "--dir", str(tmp_path), "--steps", "30", "--fail-at", "25", "--fail-rank", "1"]
        began = time.time()
        r = run(cmd, env, timeout=240)
        ended = time.time()
        assert r.proc.returncode == 0, r.stderr
        assert "planted failure at step 25" in r.stderr  # the first attempt failed, the second finished
        receiver.wait_for(lambda rx: len(_restart_points(rx)) >= 2, timeout=10)
        restart_points = _restart_points(receiver)
    summaries = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("summary-*.json"))]
    jobs = {}
    for rank in (0, 1):
        first, second = (json.loads((tmp_path / f"attempt-{n}-rank{rank}.json").read_text()) for n in (0, 1))
        (job,) = [s["job"] for s in summaries if s["rank"] == rank and "attempt" in s["job"]]
        # The first attempt: no restart (rank 0's summary was written on SIGTERM).
        (before,) = [s["job"] for s in summaries if s["rank"] == rank and "attempt" not in s["job"]]
        attempt, view = job["attempt"], job["run"]
        # The restart lies between the failure and the next attempt's first line (its
        # process began before that line); the run's wall time holds both attempts.
        assert attempt["number"] == 1 and attempt["previous_exit"] == "recorded"
        assert 0.0 < attempt["restart_s"] <= second["first_line"] - first["failed"]
        assert view["attempts"] == 2 and view["restart_s"] == attempt["restart_s"]
        assert second["end"] - first["first_line"] <= view["wall_s"] <= ended - began
        assert view["wall_s"] == pytest.approx(before["wall_s"] + job["wall_s"] + attempt["restart_s"], rel=1e-6)
        assert sum(view["activities"].values()) == pytest.approx(view["wall_s"], rel=1e-3)
        assert view["lost_progress_s"] == 0.0 and attempt["lost_steps"] == 0  # a plain loop tells no global step
        assert any(v == pytest.approx(attempt["restart_s"]) for v in restart_points[str(rank)])
        (record,) = (tmp_path / "attempts").glob(f"*/rank-{rank}.json")
        attempts = json.loads(record.read_text())["attempts"]
        assert [a["restart_count"] for a in attempts] == [0, 1] and attempts[0]["final"]
        jobs[rank] = job
    assert r.stderr.count("restart: attempt 2 of this run began") == 2
    assert r.stderr.count("run goodput over 2 attempts") == 2
    # otel-training report on all four summaries: each rank's last attempt, the job's
    # goodput over its ranks, each over its attempts.
    from otel_training.cli.report import main

    code = main(["--summary", str(tmp_path / "summary-*.json"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and len(report["files"]) == 2 and len(report["earlier_attempts"]) == 2
    assert sorted(j["rank"] for j in report["job"]) == [0, 1] and all(j["attempt"]["number"] == 1 for j in report["job"])
    assert report["modes"]["train"]["steps"] == 2 * 10  # the last attempts' steps: 21..30 on each rank
    mean = sum(jobs[rank]["run"]["goodput"] for rank in (0, 1)) / 2
    ranks = [RankJob(rank=j["rank"], job=Job.from_dict(j)) for j in report["job"]]
    assert f"job goodput: {100 * mean:.1f}% (mean over 2 ranks, over the run's attempts)" in report_lines(ranks)


@pytest.mark.slow
def test_a_plain_loop_that_tells_its_global_step_counts_the_steps_done_again(tmp_path):
    """torchrun restarts a loop that saved at step 20 and failed at 25: the restarted
    attempt resumes at 20 and does 21..25 again."""
    env = otel_env(None, tmp_path, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                   OTEL_LOGS_EXPORTER="none", OTEL_TRAINING_HARDWARE="false",
                   OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "summary-{pid}.json"))
    cmd = [str(BIN / "torchrun"), "--nnodes=1", "--nproc_per_node=1", "--max-restarts=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--no-python",
           str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(SCRIPTS / "train_restarted.py"),
           "--dir", str(tmp_path), "--steps", "30", "--fail-at", "25", "--step-ms", "60", "--tell-global-step"]
    r = run(cmd, env, timeout=240)
    assert r.proc.returncode == 0 and "planted failure at step 25" in r.stderr, r.stderr
    clock = json.loads((tmp_path / "attempt-0-rank0.json").read_text())
    (job,) = [j for j in (json.loads(p.read_text())["job"] for p in tmp_path.glob("summary-*.json")) if "attempt" in j]
    attempt = job["attempt"]
    assert attempt["resumed_at_step"] == 20 and attempt["previous_last_step"] == 25 and attempt["lost_steps"] == 5
    truth = clock["failed"] - clock["save_end"]["20"]
    assert truth >= 0.3
    assert truth * (1 - TOLERANCE) <= attempt["lost_progress_s"] <= truth * (1 + TOLERANCE), (attempt, truth)


@pytest.mark.slow
def test_a_killed_attempt_is_known_by_its_last_record(tmp_path):
    """SIGKILL (the OOM killer) at step 16, 3 s after the save at step 10, leaves no
    exit record: the record rewritten after that save stands for the attempt, and a
    rerun with the same OTEL_TRAINING_RUN_ID (a requeued job) resumes from the save."""
    env = otel_env(None, tmp_path, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                   OTEL_LOGS_EXPORTER="none", OTEL_TRAINING_HARDWARE="false", OTEL_TRAINING_RUN_ID="requeued",
                   OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "summary-{pid}.json"))
    base = [str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(SCRIPTS / "train_restarted.py"),
            "--dir", str(tmp_path), "--steps", "20", "--every", "10", "--step-ms", "500", "--tell-global-step"]
    killed = run(base + ["--fail-at", "16", "--kill"], env, timeout=240)
    assert killed.proc.returncode == -9, killed.stderr
    rerun = run(base, env, timeout=240)
    assert rerun.proc.returncode == 0, rerun.stderr
    first, second = (json.loads((tmp_path / f"attempt-{n}-rank0.json").read_text()) for n in (0, 1))
    (summary,) = [json.loads(p.read_text()) for p in tmp_path.glob("summary-*.json")]  # none from the killed one
    attempt, view = summary["job"]["attempt"], summary["job"]["run"]
    assert attempt["previous_exit"] == "killed (its last record)" and attempt["resumed_at_step"] == 10
    # The record came after the save at 10 and before the kill at 16.
    assert 10 <= attempt["previous_last_step"] < 16 and attempt["lost_steps"] == attempt["previous_last_step"] - 10
    assert attempt["lost_progress_s"] <= first["failed"] - first["save_end"]["10"]
    # The restart counts from that record: at least the time from the kill to the next
    # process's first line, less that line's own start-up (the record is at most
    # SAVE_SETTLE_S + a step older than the kill).
    assert 0 < attempt["restart_s"] <= second["first_line"] - first["failed"] + 2.0
    assert sum(view["activities"].values()) == pytest.approx(view["wall_s"], rel=1e-3)


@pytest.mark.slow
def test_an_unwritable_attempts_folder_is_said_once_and_training_goes_on(tmp_path):
    env = otel_env(None, tmp_path, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                   OTEL_LOGS_EXPORTER="none", OTEL_TRAINING_HARDWARE="false", OTEL_TRAINING_RUN_ID="nowhere",
                   OTEL_TRAINING_ATTEMPTS_DIR="/dev/null/attempts",
                   OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "summary.json"))
    r = run([str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(SCRIPTS / "train_restarted.py"),
             "--dir", str(tmp_path), "--steps", "12", "--every", "5"], env, timeout=240)
    assert r.proc.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "OTEL_TRAINING_ATTEMPTS_DIR" in line]
    assert said == [said[0]] and "cannot be written" in said[0] and "training continues" in said[0], r.stderr
    assert "Traceback" not in r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["modes"]["train"]["steps"] == 12 and summary["telemetry"]["errors"] == 0


def _restart_points(receiver) -> dict:
    """rank -> the values of training.job.time{training.activity="restart"} received."""
    out: dict = {}
    for res, attrs, value in _points(receiver, "training.job.time"):
        if attrs.get("training.activity") == "restart":
            out.setdefault(str(attrs.get(sc.ATTR_RANK, res.get(sc.ATTR_RANK))), []).append(value)
    return out


# -- lost progress with the frameworks ----------------------------------------------------
def _two_attempts(tmp_path, script: str, first: list, second: list) -> tuple:
    env = otel_env(None, tmp_path, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                   OTEL_LOGS_EXPORTER="none", OTEL_TRAINING_HARDWARE="false", OTEL_TRAINING_RUN_ID="resumed",
                   OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "summary-{pid}.json"), HF_HUB_OFFLINE="1")
    base = [str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(SCRIPTS / script), "--dir", str(tmp_path)]
    failed = run(base + first, env, timeout=300)
    assert failed.proc.returncode != 0 and "planted failure at global step 10" in failed.stderr, failed.stderr
    resumed = run(base + second, env, timeout=300)
    assert resumed.proc.returncode == 0, resumed.stderr
    clock = json.loads((tmp_path / "clock-0.json").read_text())
    (job,) = [j for j in (json.loads(p.read_text())["job"] for p in tmp_path.glob("summary-*.json")) if "attempt" in j]
    return job, clock, resumed.stderr


def _check_lost(job: dict, clock: dict) -> None:
    """Steps 9 and 10 were done again: their train time is the time from the save at
    step 8 to the failure (each step sleeps 150 ms)."""
    attempt = job["attempt"]
    assert attempt["resumed_at_step"] == 8 and attempt["previous_last_step"] == 10 and attempt["lost_steps"] == 2
    truth = clock["failed"] - clock["save_end"]["8"]
    assert truth >= 0.3
    assert truth * (1 - TOLERANCE) <= attempt["lost_progress_s"] <= truth * (1 + TOLERANCE), (attempt, truth)
    view = job["run"]
    assert view["lost_progress_s"] == attempt["lost_progress_s"]
    assert sum(view["activities"].values()) == pytest.approx(view["wall_s"], rel=1e-3)


@pytest.mark.slow
def test_hf_trainer_resumed_from_a_checkpoint_counts_the_steps_done_again(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it)")
    pytest.importorskip("transformers", reason="transformers is not installed")
    import torch

    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 6):
        pytest.skip("transformers resumes the optimizer with torch.load only on torch >= 2.6 (CVE-2025-32434)")
    job, clock, stderr = _two_attempts(tmp_path, "train_hf_resume.py", ["--fail-at", "10"], ["--resume"])
    _check_lost(job, clock)


@pytest.mark.slow
def test_lightning_resumed_from_a_checkpoint_counts_the_steps_done_again(tmp_path):
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:
        pytest.importorskip("pytorch_lightning", reason="Lightning is not installed")
    job, clock, stderr = _two_attempts(tmp_path, "train_lightning_resume.py", ["--fail-at", "10"], ["--resume-at", "8"])
    _check_lost(job, clock)
