"""DDP's gradient sync under ``torchrun --no-python opentelemetry-instrument`` (two gloo
ranks on the CPU), one delay planted per run (tests/scripts/train_ddp_planted.py):

* a slow data loader, or a slow backward, on rank 1: rank 1 is the straggler, named
  with that phase; rank 0 waits for it in ``communication`` (a child of ``backward``),
  within 30% of the planted delay; nothing is communication-bound;
* a slow all-reduce on every rank (a comm hook whose future completes late): every
  rank's ``communication`` holds the delay; communication-bound, no straggler;
* nothing planted: no straggler, not communication-bound;
* FSDP2 (``fully_shard``), rank 1's loader slow: rank 0 waits in FSDP's collectives
  (``communication`` under ``forward`` and ``backward``) for the planted delay.

Every rank's forward sleeps 30 ms (its compute), so the planted 80 ms stand far above
the noise of a loaded machine.
"""

from __future__ import annotations

import json

import pytest

from otel_training.aggregate.run_model import Run
from otel_training.diagnosis.verdict import diagnose
from otel_training.report.build import diagnosed
from otel_training.report.model import Report
from otel_training.report.sources import load_summaries
from tests.otlp_receiver import free_port
from tests.scripts.harness import BIN, ROOT, SCRIPTS, otel_env, run

pytestmark = pytest.mark.slow

PLANT_MS = 80.0
STEPS = 25


def _torchrun(tmp, plant: str, *extra: str) -> list[dict]:
    env = otel_env(None, tmp, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                   OTEL_LOGS_EXPORTER="none", OTEL_TRAINING_HARDWARE="false", GLOO_SOCKET_IFNAME="lo",
                   OTEL_TRAINING_SUMMARY_FILE=str(tmp / f"{plant}-{{rank}}.json"))
    cmd = [str(BIN / "torchrun"), "--nnodes=1", "--nproc_per_node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--no-python", str(BIN / "opentelemetry-instrument"),
           str(BIN / "python"), str(SCRIPTS / "train_ddp_planted.py"), "--steps", str(STEPS), "--plant", plant,
           "--plant-ms", str(PLANT_MS), *extra]
    r = run(cmd, env, timeout=240)
    assert r.proc.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return [str(tmp / f"{plant}-{rank}.json") for rank in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grad_sync")
    out = {plant: _torchrun(tmp, plant) for plant in ("loader", "backward", "allreduce", "none")}
    (tmp / "fsdp").mkdir()
    out["fsdp"] = _torchrun(tmp / "fsdp", "loader", "--fsdp")
    return out


def _report(files: list[str]) -> Report:
    return diagnosed(load_summaries(files))


def _ms(summary_file: str, name: str) -> float:
    """Milliseconds per step in phase ``name`` (every parent)."""
    mode = json.load(open(summary_file))["modes"]["train"]
    return sum(p["mean_s"] for p in mode["phases"] if p["name"] == name) * 1e3


def _extra_ms(files: list[str], phase: str) -> float:
    """What the slow rank (1) really spent in ``phase`` beyond rank 0, per step, by the
    ranks' own files: the planted delay as it happened (a loaded machine stretches it)."""
    return _own_ms(files[1], phase) - _own_ms(files[0], phase)


def _own_ms(summary_file: str, name: str) -> float:
    """Milliseconds per step in phase ``name``, less the communication inside it (a
    backward holds the gradient all-reduce's wait)."""
    phases = json.load(open(summary_file))["modes"]["train"]["phases"]
    inside = sum(p["mean_s"] for p in phases if p["name"] == "communication" and p["parent"] == name)
    return (sum(p["mean_s"] for p in phases if p["name"] == name) - inside) * 1e3


def _waits_for(waited: float, extra: float) -> None:
    """Rank 0's wait is the slow rank's extra time (within 30%, and 10 ms of the two
    ranks' other differences on a loaded machine); planted 80 ms, it is at least 56."""
    assert extra >= 0.7 * PLANT_MS, extra
    assert 0.7 * extra <= waited <= 1.3 * extra + 10, (waited, extra)


def _kinds(report: Report) -> list[str]:
    return [f.kind for f in report.findings or ()]


@pytest.mark.parametrize("plant,cause", [("loader", "dataloader_next"), ("backward", "backward")])
def test_a_slow_rank_is_the_straggler_by_its_phase_and_the_other_waits_in_communication(runs, plant, cause):
    files = runs[plant]
    rep = _report(files)
    first = rep.first_finding()
    assert first and first.kind == "straggler" and first.rank == 1 and first.phase == cause, rep.findings
    assert f"its {cause} takes" in first.detail
    assert "communication_bound" not in _kinds(rep) and "compute_bound" != _kinds(rep)[0]
    waited = _ms(files[0], "communication")
    _waits_for(waited, _extra_ms(files, cause))
    assert _ms(files[1], "communication") < 0.3 * PLANT_MS  # the straggler hardly waits
    ranks = {r.rank: r for r in rep.rank_rows("train")}
    assert ranks[1].step_mean_s - (ranks[1].wait_mean_s or 0.0) > ranks[0].step_mean_s - (ranks[0].wait_mean_s or 0.0)
    # rank 0's own summary: it waits in the gradient sync, and is never called compute-bound
    own = [f.kind for f in diagnose(Run.from_json(open(files[0]).read()))]
    assert "sync_wait" in own and "compute_bound" not in own, own


def test_a_slow_allreduce_on_every_rank_is_communication_bound(runs):
    files = runs["allreduce"]
    rep = _report(files)
    assert _kinds(rep)[0] == "communication_bound", rep.findings
    assert "straggler" not in _kinds(rep) and "compute_bound" not in _kinds(rep)
    advice = " ".join((rep.findings or ())[0].advice)
    assert all(w in advice for w in ("no_sync", "bucket_cap_mb", "bf16_compress_hook", "NCCL_SOCKET_IFNAME"))
    for f in files:
        assert 0.7 * PLANT_MS <= _ms(f, "communication") <= 1.3 * PLANT_MS, f


def test_nothing_planted_names_nothing(runs):
    rep = _report(runs["none"])
    kinds = _kinds(rep)
    assert not {"straggler", "communication_bound", "rank_slowdown"} & set(kinds), rep.findings
    for f in runs["none"]:
        assert _ms(f, "communication") < 0.3 * PLANT_MS


def test_fsdp_collectives_are_communication_where_they_block(runs):
    files = runs["fsdp"]
    parents = {p["parent"] for p in json.load(open(files[0]))["modes"]["train"]["phases"]
               if p["name"] == "communication"}
    assert parents == {"forward", "backward"}, parents
    waited = _ms(files[0], "communication") - _ms(files[1], "communication")
    _waits_for(waited, _extra_ms(files, "dataloader_next"))
    first = _report(files).first_finding()
    assert first and first.kind == "straggler" and first.rank == 1 and first.phase == "dataloader_next", first
