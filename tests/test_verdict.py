"""verdict.diagnose: each bottleneck class is recognised and ranked by the share it explains."""

from otel_training.aggregate.run_model import Run
from otel_training.diagnosis.evidence import Evidence, RankTimes
from otel_training.diagnosis.findings_text import render_findings, verdict_line
from otel_training.diagnosis.verdict import diagnose


def _diagnose(s):
    """``diagnose`` on a summary dict, with a report's ``ranks`` and ``gpu_utilization`` where given."""
    run = Run.from_dict({k: v for k, v in s.items() if k not in ("ranks", "gpu_utilization")})
    ranks = tuple(RankTimes.from_dict(r) for r in s.get("ranks") or ())
    return diagnose(Evidence.of_run(run, ranks, (s.get("gpu_utilization") or {}).get("mean")))


def _summary(shares, children=None, mode="train", gpu=None, ranks=None, idle=None, **tel):
    step_time = 10.0
    phases = [{"name": n, "parent": "step", "total_s": s * step_time, "mean_s": s * step_time / 100,
               "count": 100, "share": s} for n, s in shares.items()]
    for n, s in (children or {}).items():
        phases.append({"name": n, "parent": "train_batch", "total_s": s * step_time,
                       "mean_s": 0.0, "count": 100, "share": s})
    out = {"schema": "otel-training/summary/v1", "modes": {mode: {
        "steps": 100, "samples": 3200, "step_time_s": step_time, "wall_s": 10.5,
        "step_mean_s": 0.1, "phases": phases, "gpu_idle_s": idle or {}}},
        "telemetry": {"spans_dropped": 0, "steps_dropped": 0, "export_failures": 0, "errors": 0, **tel}}
    if gpu is not None:
        out["gpu_utilization"] = gpu
    if ranks is not None:
        out["ranks"] = ranks
    return out


def test_data_loading_bound_ranks_first_with_worker_advice():
    s = _summary({"dataloader_next": 0.55, "train_batch": 0.35, "untracked": 0.10},
                 idle={"dataloader_next": 5.0})
    f = _diagnose(s)
    assert f[0].kind == "data_loading"
    assert f[0].score == 0.55 and f[0].severity == "high"
    assert "55% of train step time" in f[0].detail
    assert "the GPU sat idle while it waited: 50% of train step time" in f[0].detail
    text = " ".join(f[0].advice)
    for word in ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "cache"):
        assert word in text
    assert verdict_line(f).startswith("verdict: data-loading bound: ")


def test_data_loading_advice_follows_the_loader_that_drove_the_run():
    """A run fed by a Grain pipeline (torchtitan) gets Grain's fixes; one fed by both
    kinds gets both; a summary without ``loaders`` (older files, Prometheus) the
    DataLoader's."""
    base = {"dataloader_next": 0.55, "train_batch": 0.35, "untracked": 0.10}
    grain = " ".join(_diagnose({**_summary(base), "loaders": ["grain"]})[0].advice)
    assert "ReadOptions" in grain and "mp_prefetch" in grain and "persistent_workers" not in grain
    both = " ".join(_diagnose({**_summary(base), "loaders": ["grain", "torch"]})[0].advice)
    assert "ReadOptions" in both and "persistent_workers" in both
    for summary in (_summary(base), {**_summary(base), "loaders": ["torch"]}):
        text = " ".join(_diagnose(summary)[0].advice)
        assert "persistent_workers" in text and "ReadOptions" not in text


def test_gpu_bound_versus_launch_bound_depends_on_utilization():
    shares = {"dataloader_next": 0.05, "train_batch": 0.9, "untracked": 0.05}
    busy = _diagnose(_summary(shares, {"forward": 0.3, "backward": 0.5, "optimizer_step": 0.1},
                             gpu={"mean": 0.95, "min": 0.9}))
    assert busy[0].kind == "gpu_bound"
    assert any("mixed precision" in a for a in busy[0].advice)
    assert any("batch size" in a for a in busy[0].advice)
    assert "backward is the largest part" in busy[0].detail
    idle = _diagnose(_summary(shares, gpu={"mean": 0.3, "min": 0.1}))
    assert idle[0].kind == "launch_bound"
    cpu = _diagnose(_summary(shares))
    assert cpu[0].kind == "compute_bound"


def test_slow_callback_is_named_with_its_hook():
    s = _summary({"dataloader_next": 0.05, "train_batch": 0.35, "untracked": 0.05,
                  "callback.SlowLogger.on_train_batch_end": 0.5,
                  "callback.ProgressBar.on_train_batch_end": 0.05})
    f = _diagnose(s)
    assert f[0].kind == "callback"
    assert f[0].title == "slow callback SlowLogger"
    assert "SlowLogger.on_train_batch_end" in f[0].detail
    assert not any(x.title == "slow callback ProgressBar" for x in f)


def test_untracked_user_phase_and_syncs():
    s = _summary({"dataloader_next": 0.1, "train_batch": 0.3, "untracked": 0.25,
                  "logging": 0.2, "from_device": 0.15})
    kinds = [x.kind for x in _diagnose(s)]
    assert kinds[:3] == ["untracked", "user_phase", "device_sync"]


def test_host_to_device():
    f = _diagnose(_summary({"to_device": 0.4, "train_batch": 0.5, "untracked": 0.1}))
    assert f[0].kind == "host_to_device"
    assert any("non_blocking=True" in a and "pin_memory" in a for a in f[0].advice)


def test_balanced_when_nothing_dominates():
    s = _summary({"dataloader_next": 0.1, "to_device": 0.05, "train_batch": 0.5,
                  "from_device": 0.05, "untracked": 0.1, "logging": 0.1, "step_lr_schedulers": 0.01})
    f = _diagnose(s)
    assert [x.kind for x in f] == ["balanced"]
    assert "no dominant bottleneck" in f[0].detail


def test_straggler_names_rank_host_and_phase():
    ranks = [{"rank": r, "host": f"node{r}", "step_mean_s": 0.1,
              "phases": {"dataloader_next": 0.1, "train_batch": 0.8}} for r in range(4)]
    ranks[2].update(step_mean_s=0.2, phases={"dataloader_next": 0.5, "train_batch": 0.45})
    f = _diagnose(_summary({"dataloader_next": 0.1, "train_batch": 0.5, "untracked": 0.1,
                           "reduce_metrics": 0.3}, ranks=ranks))
    st = next(x for x in f if x.kind == "straggler")
    assert st.rank == 2 and "node2" in st.detail and "2.00x" in st.detail
    assert "dataloader_next share is 40% higher" in st.detail
    assert f[0].kind == "straggler"  # 50% of the others' step time is waiting for rank 2


def test_straggler_prefers_seconds_per_step():
    ranks = [{"rank": r, "step_mean_s": 0.1, "phases": {"dataloader_next": 0.2, "train_batch": 0.8},
              "phase_mean_s": {"dataloader_next": 0.02, "train_batch": 0.08}} for r in range(3)]
    # rank 1: data loading +50 ms/step; its train_batch share drops although compute is unchanged
    ranks[1].update(step_mean_s=0.15, phases={"dataloader_next": 0.47, "train_batch": 0.53},
                    phase_mean_s={"dataloader_next": 0.07, "train_batch": 0.08})
    st = next(x for x in _diagnose(_summary({"train_batch": 0.9}, ranks=ranks)) if x.kind == "straggler")
    assert "dataloader_next takes 50.0 ms more per step" in st.detail and "1.50x" in st.detail


def test_eval_only_and_empty_summaries():
    f = _diagnose(_summary({"dataloader_next": 0.7, "eval_batch": 0.3}, mode="eval"))
    assert f[0].kind == "data_loading" and "eval step time" in f[0].detail
    assert _diagnose({"schema": "otel-training/summary/v1", "modes": {}})[0].kind == "no_data"


def test_telemetry_loss_is_reported_last_and_format():
    f = _diagnose(_summary({"dataloader_next": 0.5, "train_batch": 0.5}, spans_dropped=3))
    assert f[-1].kind == "telemetry_loss"
    text = "\n".join(render_findings(f))
    assert text.splitlines()[0].startswith("verdict: data-loading bound")
    assert "  1. [high]" in text and "     - raise DataLoader num_workers" in text
    assert f[0].to_dict()["severity"] == "high"


def test_straggler_hidden_by_synchronization_is_found_by_its_own_time():
    # DDP: every rank takes 200 ms a step; rank 3 loads data for 120 ms while the
    # others load for 20 ms and then wait ~100 ms for it inside backward.
    ranks = [{"rank": r, "host": f"node{r}", "step_mean_s": 0.2,
              "phase_mean_s": {"dataloader_next": 0.02, "forward": 0.03, "backward": 0.14}} for r in range(4)]
    ranks[3]["phase_mean_s"] = {"dataloader_next": 0.12, "forward": 0.03, "backward": 0.04}
    st = next(x for x in _diagnose(_summary({"train_batch": 0.9}, ranks=ranks)) if x.kind == "straggler")
    assert st.rank == 3 and "node3" in st.detail
    assert "dataloader_next takes 100.0 ms more per step" in st.detail


def test_even_synchronized_ranks_are_no_stragglers():
    ranks = [{"rank": r, "step_mean_s": 0.2,
              "phase_mean_s": {"dataloader_next": 0.02, "backward": 0.14}} for r in range(4)]
    assert not [x for x in _diagnose(_summary({"train_batch": 0.9}, ranks=ranks)) if x.kind == "straggler"]
