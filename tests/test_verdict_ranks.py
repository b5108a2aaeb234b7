"""Rank verdicts over summaries (diagnosis/verdict_ranks.py): own work names the
straggler with its slow part, every rank waiting is communication-bound, a waiting
rank is never compute-bound, and a rank is compared with its own best."""

from __future__ import annotations

import pytest

from otel_training.diagnosis.verdict_ranks import own_work_parts
from tests.test_verdict import _diagnose, _summary


def _rank(rank, step, waits, parts):
    return {"rank": rank, "host": f"node{rank}", "step_mean_s": step, "phases": {}, "wait_mean_s": waits,
            "part_mean_s": parts}


def test_own_work_parts_take_the_waits_out_of_their_parents():
    waits, parts = own_work_parts([("train_batch", "step", 0.2), ("forward", "train_batch", 0.03),
                                   ("backward", "train_batch", 0.16), ("communication", "backward", 0.1),
                                   ("dataloader_next", "step", 0.01), ("reduce_metrics", "step", 0.02)])
    assert waits == pytest.approx(0.12)
    assert parts == pytest.approx({"forward": 0.03, "backward": 0.06, "dataloader_next": 0.01})


def test_equal_steps_and_equal_backward_the_straggler_is_named_by_its_backward_compute():
    # rank 1 computes 100 ms more in backward; rank 0 waits for it in communication
    ranks = [_rank(0, 0.2, 0.1, {"forward": 0.03, "backward": 0.05, "dataloader_next": 0.01}),
             _rank(1, 0.2, 0.0, {"forward": 0.03, "backward": 0.15, "dataloader_next": 0.01})]
    f = _diagnose(_summary({"train_batch": 0.95, "dataloader_next": 0.05}, ranks=ranks))
    st = next(x for x in f if x.kind == "straggler")
    assert st.rank == 1 and st.phase == "backward" and "node1" in st.detail
    assert "its backward takes 100.0 ms more per step" in st.detail
    assert "communication_bound" not in [x.kind for x in f]


def test_every_rank_waiting_is_communication_bound_and_no_straggler():
    ranks = [_rank(r, 0.2, 0.12, {"forward": 0.03, "backward": 0.04}) for r in range(4)]
    f = _diagnose(_with_communication(_summary({"train_batch": 0.95}, children={"forward": 0.15, "backward": 0.8},
                                              ranks=ranks), 0.6))
    kinds = [x.kind for x in f]
    assert kinds[0] == "communication_bound" and "straggler" not in kinds
    assert "no_sync" in " ".join(f[0].advice) and "NCCL_SOCKET_IFNAME" in " ".join(f[0].advice)


def test_even_ranks_with_noise_name_nothing():
    ranks = [_rank(r, 0.035, 0.001 + 0.0005 * r, {"forward": 0.031 + 0.001 * r}) for r in range(4)]
    kinds = [x.kind for x in _diagnose(_summary({"train_batch": 0.95}, ranks=ranks))]
    assert "straggler" not in kinds and "communication_bound" not in kinds


def _with_communication(s, share):
    s["modes"]["train"]["phases"].append({"name": "communication", "parent": "backward", "total_s": 10 * share,
                                          "mean_s": share / 10, "count": 100, "share": share})
    return s


def test_a_waiting_rank_alone_is_no_compute_bound():
    # one rank's own summary: backward 80% of the step, of which communication 70%
    s = _with_communication(_summary({"train_batch": 0.98}, children={"forward": 0.15, "backward": 0.8}), 0.7)
    kinds = [x.kind for x in _diagnose(s)]
    assert "sync_wait" in kinds and "compute_bound" not in kinds, kinds


def _series(own_ms, wait_ms=20.0):
    n = len(own_ms)
    return {"width": 10, "steps": [10] * n, "step_s": [(o + wait_ms) * 10 / 1e3 for o in own_ms],
            "wait_s": [wait_ms * 10 / 1e3] * n}


def test_a_rank_slowing_against_its_own_best_is_named():
    s = _summary({"train_batch": 0.95})
    s.update(rank=3, host="node3", timeseries={"train": _series([50.0] * 12 + [52.0] * 6 + [75.0] * 6)})
    slow = next(x for x in _diagnose(s) if x.kind == "rank_slowdown")
    assert slow.rank == 3 and "node3" in slow.detail and "50.0 ms" in slow.detail and "75.0 ms" in slow.detail


def test_a_steady_rank_is_not_slowing():
    s = _summary({"train_batch": 0.95})
    s["timeseries"] = {"train": _series([50.0, 55.0, 48.0, 52.0] * 6)}
    assert "rank_slowdown" not in [x.kind for x in _diagnose(s)]
