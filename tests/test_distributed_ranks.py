"""The rank of launchers that do not set ``RANK`` at start-up, learned from the process
group, under ``opentelemetry-instrument`` exporting to a real OTLP receiver.

* Lightning's own launcher (``Trainer(strategy="ddp", devices=2)``): rank 0 starts rank 1
  as a copy of its command line with ``LOCAL_RANK`` and ``WORLD_SIZE``, no ``RANK``;
* ``torch.multiprocessing.spawn``: the children see only ``MASTER_ADDR``/``MASTER_PORT``
  and pass their rank to ``init_process_group``.

Each process's exported points and spans carry its own rank (the one the script itself
prints), world size 2, and each writes its own ``summary-{rank}.json``. What is not known
at start-up is said once, never exported as a guessed 0.
"""

from __future__ import annotations

import json

import pytest

from tests.otlp_receiver import OTLPReceiver, attributes, data_points, free_port
from tests.scripts.harness import instrumented, otel_env, run

pytestmark = pytest.mark.slow

STEPS = 6
MISSING_LINE = "otel-training: training.rank"


def _launch(tmp, script, *args):
    with OTLPReceiver() as receiver:
        env = otel_env(receiver.endpoint, tmp, OTEL_METRIC_EXPORT_INTERVAL="1000", GLOO_SOCKET_IFNAME="lo",
                       OTEL_TRAINING_TRACE_EVERY_N="1", OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000",
                       OTEL_TRAINING_SUMMARY_FILE=str(tmp / "summary-{rank}.json"))
        # ~30 s on an idle 2-core machine: two ranks start torch (and Lightning) each. The
        # limit is below pytest's 300 s, so a hang ends in the harness, with the job's stderr.
        r = run(instrumented(script, "--steps", str(STEPS), *args), env, timeout=240)
        assert r.proc.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr

        def both(rc):
            return len({res.get("service.instance.id") for res, m in rc.metrics() if m.name == "training.steps"}) == 2

        receiver.wait_for(both, timeout=120)
        truth = {}
        for line in r.stdout.splitlines():
            if line.startswith("RANK_OF "):
                pid, rank, world = map(int, line.split()[1:])
                truth[pid] = (rank, world)
        return {"receiver": receiver, "run": r, "tmp": tmp, "truth": truth}


@pytest.fixture(scope="module")
def lightning_job(tmp_path_factory):
    pytest.importorskip("lightning")
    return _launch(tmp_path_factory.mktemp("lightning-ddp"), "train_lightning_ddp.py")


@pytest.fixture(scope="module")
def spawn_job(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("spawn-ddp"), "train_mp_spawn_ddp.py", "--port", str(free_port()))


def _ranks_by_process(job):
    """service.instance.id -> the set of (rank, local rank, world size) on its points and spans."""
    seen: dict = {}
    for res, scope, m in job["receiver"].scoped_metrics():
        if scope != "otel_training":
            continue
        for p in data_points(m):
            a = attributes(p.attributes)
            if "training.rank" in a or m.name in ("training.steps", "training.step.duration"):
                key = (a.get("training.rank"), a.get("training.local_rank"), a.get("training.world_size"))
                seen.setdefault(res["service.instance.id"], set()).add(key)
    for res, s in job["receiver"].spans():
        if s.name == "step":
            a = attributes(s.attributes)
            key = (a.get("training.rank"), a.get("training.local_rank"), a.get("training.world_size"))
            seen.setdefault(res["service.instance.id"], set()).add(key)
    return seen


def _check(job, local_rank_known):
    assert sorted(job["truth"].values()) == [(0, 2), (1, 2)]  # the scripts' own view
    seen = _ranks_by_process(job)
    assert len(seen) == 2, seen
    # One identity per process, none guessed: each its own rank, world size 2.
    for keys in seen.values():
        assert len(keys) == 1, keys
    ranks = sorted(next(iter(keys)) for keys in seen.values())
    if local_rank_known:
        assert ranks == [(0, 0, 2), (1, 1, 2)]
    else:  # mp.spawn: no variable gives it
        assert ranks == [(0, None, 2), (1, None, 2)]
    files = sorted(p.name for p in job["tmp"].glob("summary-*.json"))
    assert files == ["summary-0.json", "summary-1.json"]
    for name in files:
        summary = json.loads((job["tmp"] / name).read_text())
        assert job["truth"][summary["pid"]] == (summary["rank"], summary["world_size"])
        assert name == f"summary-{summary['rank']}.json"
        assert summary["modes"]["train"]["steps"] == STEPS


def test_lightning_ddp_launcher_ranks(lightning_job):
    _check(lightning_job, local_rank_known=True)
    # Only the child started without its rank (rank 0 looks like a single process then).
    lines = [ln for ln in lightning_job["run"].stderr_lines() if ln.startswith(MISSING_LINE)]
    assert len(lines) == 1 and "no RANK" in lines[0], lines


@pytest.mark.core  # wraps torch.distributed.init_process_group: checked on every torch of the range
def test_mp_spawn_ranks(spawn_job):
    _check(spawn_job, local_rank_known=False)
    lines = [ln for ln in spawn_job["run"].stderr_lines() if ln.startswith(MISSING_LINE)]
    assert len(lines) == 2, lines  # once per child
