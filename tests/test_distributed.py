"""Distributed: two ranks under ``opentelemetry-instrument torchrun``
(gloo on CPU, rendezvous on loopback) export to a real OTLP receiver.

* every training and self-telemetry data point, and every ``step`` span, carries
  ``training.rank``, ``training.local_rank`` and ``training.world_size``; the ranks are
  separate processes (one ``service.instance.id`` each) of one run (the torchrun run id);
* the user's ``all_reduce``/``all_gather`` are ``reduce_metrics`` phases;
* one process per host samples the hardware: no hardware series twice;
* a deliberately slowed rank stands out in the per-rank ``training.step.duration``.
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.otlp_receiver import OTLPReceiver, attributes, data_points, free_port
from tests.scripts.harness import BIN, SCRIPTS, otel_env, run

pytestmark = pytest.mark.slow

STEPS = 30
SYNC_EVERY = 5
SLOW_RANK = 1
SLOW_MS = 40.0
RANK_KEYS = ("training.rank", "training.local_rank", "training.world_size")


def _scoped_metrics(receiver):
    """(resource attributes, scope name, metric) for everything received."""
    return receiver.scoped_metrics()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    run_id = uuid.uuid4().hex
    with OTLPReceiver() as receiver:
        env = otel_env(receiver.endpoint, tmp, OTEL_METRIC_EXPORT_INTERVAL="1000",
                       OTEL_TRAINING_TRACE_EVERY_N="1", OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000",
                       OTEL_TRAINING_HARDWARE_INTERVAL="0.2", GLOO_SOCKET_IFNAME="lo",
                       OTEL_TRAINING_SUMMARY_FILE=str(tmp / "summary-{rank}.json"))
        cmd = [str(BIN / "opentelemetry-instrument"), str(BIN / "torchrun"), "--nnodes=1", "--nproc_per_node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_id}",
               str(SCRIPTS / "train_ddp.py"), "--steps", str(STEPS), "--sync-every", str(SYNC_EVERY),
               "--slow-rank", str(SLOW_RANK), "--slow-ms", str(SLOW_MS)]
        r = run(cmd, env, timeout=300)
        assert r.proc.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        receiver.wait_for(lambda rc: len({res.get("service.instance.id") for res, m in rc.metrics()
                                          if m.name == "training.steps"}) == 2)
        yield {"receiver": receiver, "run_id": run_id, "stdout": r.stdout, "tmp": tmp}


def _training(job):
    """Metrics from the ranks: (resource, metric) of scope otel_training."""
    return [(res, m) for res, scope, m in _scoped_metrics(job["receiver"]) if scope == "otel_training"]


def test_each_rank_is_its_own_process_of_one_run(job):
    ranks = {}
    for res, m in _training(job):
        if m.name == "training.steps":
            for p in data_points(m):
                ranks.setdefault(attributes(p.attributes)["training.rank"], set()).add(
                    (res["service.instance.id"], res["training.run.id"]))
    assert sorted(ranks) == [0, 1]
    assert all(len(ids) == 1 for ids in ranks.values())
    (a,), (b,) = ranks.values()
    assert a[0] != b[0]  # one service.instance.id per process
    assert a[1] == b[1] == job["run_id"]  # the torchrun run id


def test_every_training_point_and_span_carries_the_rank(job):
    seen = set()
    for res, m in _training(job):
        for p in data_points(m):
            attrs = attributes(p.attributes)
            if not m.name.startswith("training.telemetry.") or "training.rank" in attrs:
                assert {k: attrs.get(k) is not None for k in RANK_KEYS} == dict.fromkeys(RANK_KEYS, True), (
                    m.name, attrs)
                assert attrs["training.world_size"] == 2
                assert attrs["training.local_rank"] == attrs["training.rank"]
                seen.add(m.name)
    assert {"training.step.duration", "training.phase.duration", "training.steps", "training.samples",
            "training.telemetry.spans.dropped", "training.telemetry.export.failures"} <= seen
    spans = [s for _, s in job["receiver"].spans()]
    assert len([s for s in spans if s.name == "step"]) == 2 * STEPS
    assert {s.name for s in spans} > {"step", "forward", "backward"}
    for s in spans:  # phase spans too, so a trace search by rank finds them
        attrs = attributes(s.attributes)
        assert all(attrs.get(k) is not None for k in RANK_KEYS), (s.name, attrs)


def test_self_telemetry_of_the_ranks_is_per_rank(job):
    by_rank = {}
    for res, m in _training(job):
        if m.name == "training.telemetry.spans.dropped":
            for p in data_points(m):
                rank = attributes(p.attributes).get("training.rank")
                if rank is not None:
                    by_rank.setdefault(rank, set()).add(res["service.instance.id"])
    assert sorted(by_rank) == [0, 1] and all(len(v) == 1 for v in by_rank.values())


def test_user_collectives_are_reduce_metrics_phases(job):
    spans = job["receiver"].spans()
    by_id = {s.span_id: s for _, s in spans}
    reduce = [s for _, s in spans if s.name == "reduce_metrics"]
    syncs = STEPS // SYNC_EVERY
    # all_reduce and all_gather, one after the other in the same step: one phase each.
    assert len(reduce) == 2 * 2 * syncs, len(reduce)
    for s in reduce:
        parent = by_id[s.parent_span_id]
        assert parent.name == "step"
    totals = {}
    for res, m in _training(job):
        if m.name == "training.phase.duration":
            for p in data_points(m):
                attrs = attributes(p.attributes)
                if attrs["training.phase"] == "reduce_metrics":
                    totals[attrs["training.rank"]] = (p.count, p.sum)
    assert {r: c for r, (c, _) in totals.items()} == {0: syncs, 1: syncs}  # steps with a collective
    # The fast rank waits in the collectives for the slow one.
    assert totals[1 - SLOW_RANK][1] > totals[SLOW_RANK][1] + 0.5 * (SYNC_EVERY - 1) * SLOW_MS / 1e3 * syncs


def _histograms(job, name):
    """The final (cumulative) point of ``name`` per rank."""
    last = {}
    for res, m in _training(job):
        if m.name == name:
            for p in data_points(m):
                last[attributes(p.attributes)["training.rank"]] = p
    return last


def _median_bound(point) -> float:
    """Upper bound of the bucket that holds the median."""
    half, seen = point.count / 2, 0
    bounds = list(point.explicit_bounds) + [float("inf")]
    for bound, n in zip(bounds, point.bucket_counts):
        seen += n
        if seen >= half:
            return bound
    return float("inf")


def test_a_slowed_rank_stands_out_in_its_step_durations(job):
    hist = _histograms(job, "training.step.duration")
    assert sorted(hist) == [0, 1] and all(h.count == STEPS for h in hist.values())
    slow, fast = hist[SLOW_RANK], hist[1 - SLOW_RANK]
    # Collectives every few steps make the fast rank wait, so the means meet; the
    # typical (median) step shows the straggler ...
    assert _median_bound(slow) >= SLOW_MS / 1e3
    assert _median_bound(slow) > _median_bound(fast)
    # ... and so does the step time outside the collectives.
    reduce = {}
    for res, m in _training(job):
        if m.name == "training.phase.duration":
            for p in data_points(m):
                a = attributes(p.attributes)
                if a["training.phase"] == "reduce_metrics":
                    reduce[a["training.rank"]] = p.sum
    own = {r: hist[r].sum - reduce.get(r, 0.0) for r in hist}
    assert own[SLOW_RANK] - own[1 - SLOW_RANK] >= 0.5 * STEPS * SLOW_MS / 1e3


def test_one_hardware_sampler_per_host(job):
    sources = {}
    for res, scope, m in _scoped_metrics(job["receiver"]):
        if scope == "otel_training.hardware" and m.name.startswith("system.") and data_points(m):
            sources.setdefault(m.name, set()).add(res["service.instance.id"])
    assert "system.cpu.utilization" in sources
    assert all(len(v) == 1 for v in sources.values()), sources  # no host series twice
    assert len(set().union(*sources.values())) == 1


def test_one_summary_file_per_rank(job):
    """The instrumented torchrun launcher (no RANK, no steps) must not overwrite rank 0's."""
    files = sorted(job["tmp"].glob("summary-*.json"))
    assert [f.name for f in files] == ["summary-0.json", "summary-1.json"]
    for rank, f in enumerate(files):
        summary = json.loads(f.read_text())
        assert summary["rank"] == rank and summary["world_size"] == 2
        assert summary["run_id"] == job["run_id"]
        assert summary["modes"]["train"]["steps"] == STEPS
        assert summary["telemetry"]["errors"] == 0
