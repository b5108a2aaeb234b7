"""The loop suite's nanoGPT script on a GPU, as nanoGPT runs there: a GPT-2-small-width
model, bf16 autocast, fused AdamW, pinned ``non_blocking`` batches, once eager and once
under ``torch.compile``, under ``opentelemetry-instrument`` over real OTLP, with the
hardware gauges on (marked ``gpu``; skipped without CUDA).

Every check of the CPU loop suite (``tests/loops/test_loops.py``) must hold there too,
and on top: the timing mode is the one asked; the phases of every step span add up to
it; the GPU idle time of the planted log line lands on ``untracked``; FLOPs per step
and MFU agree with nanoGPT's own analytic estimate (``estimate_mfu``) within 10 %; the
run exports real ``hw.gpu.*`` gauges for the GPU it trains on.

``events`` against ``sync`` is not compared here: they time two processes, and this
loop is bound by the host's launches, whose speed differs more from one process to the
next than 5 %. ``benchmarks/gpu_timing_profiler.py`` checks each mode against the
kernel timeline of its own run instead (docs/gpu-timing.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.loops import test_loops as suite  # noqa: E402
from tests.loops._run import cleanup, run_loop  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCRIPT = "nanogpt_accum"
RUNS = {
    "events": {"OTEL_TRAINING_GPU_TIMING": "events"},
    "sync": {"OTEL_TRAINING_GPU_TIMING": "sync"},
    "compiled": {"OTEL_TRAINING_GPU_TIMING": "events", "LOOPS_COMPILE": "1"},
}
SUITE_CHECKS = [suite.test_runs_clean, suite.test_step_counts, suite.test_step_spans, suite.test_microbatches,
                suite.test_skipped_updates, suite.test_planted_delays, suite.test_coverage,
                suite.test_self_check_silent]
NANOGPT_AGREE = 0.10


@pytest.fixture(scope="module")
def gpu_runs():
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            env = {"LOOPS_DEVICE": "cuda", "OTEL_TRAINING_HARDWARE": "true", **RUNS[name]}
            cache[name] = r = run_loop(SCRIPT, extra_env=env, timeout=400)
            dump = os.environ.get("GPU_LOOPS_DUMP")  # a folder: each run's truth, summary and spans
            if dump:
                Path(dump).mkdir(parents=True, exist_ok=True)
                doc = {"truth": r.truth, "summary": r.summary, "stderr": r.stderr[-4000:],
                       "spans": [(n, s.hex(), p.hex(), a, b, attrs) for n, s, p, a, b, attrs in r.spans]}
                (Path(dump) / f"{name}.json").write_text(json.dumps(doc, default=str))
        return cache[name]

    yield get
    cleanup()


@pytest.fixture(params=sorted(RUNS))
def loop(gpu_runs, request):
    r = gpu_runs(request.param)
    assert r.error is None, f"{request.param}: the runner failed: {r.error}"
    return r


@pytest.mark.parametrize("check", SUITE_CHECKS, ids=lambda f: f.__name__.removeprefix("test_"))
def test_the_loop_suite_holds_on_the_gpu(loop, check):
    check(loop)


@pytest.fixture(scope="module")
def timm_on_gpu():
    """timm train.py's shape on CUDA: training through the task wrapper, validate() on the
    wrapped model, the PrefetchLoader's side-stream copies one batch ahead."""
    r = run_loop("timm_task_wrapper", extra_env={"LOOPS_DEVICE": "cuda", "OTEL_TRAINING_GPU_TIMING": "events"},
                 timeout=400)
    assert r.error is None, f"timm_task_wrapper: the runner failed: {r.error}"
    return r


@pytest.mark.parametrize("check", SUITE_CHECKS, ids=lambda f: f.__name__.removeprefix("test_"))
def test_the_timm_shape_holds_on_the_gpu(timm_on_gpu, check):
    check(timm_on_gpu)


def test_every_timm_step_has_its_forward(timm_on_gpu):
    """Each train step's train_batch holds one forward, then one backward (the forward's
    time not booked under backward); each eval step holds one forward."""
    spans = timm_on_gpu.spans
    kids: dict = {}
    for name, sid, parent, start, _end, attrs in spans:
        kids.setdefault(parent, []).append((start, name, sid))
    seen = {"train": 0, "eval": 0}
    for name, sid, parent, _start, _end, attrs in spans:
        if name != "step" or parent:
            continue
        mode = attrs.get("training.mode")
        batch = [k for k in sorted(kids.get(sid, [])) if k[1] in ("train_batch", "eval_batch")]
        assert len(batch) == 1, (mode, attrs.get("training.step"), kids.get(sid))
        inner = [k[1] for k in sorted(kids.get(batch[0][2], []))]
        want = ["forward", "backward", "optimizer_step"] if mode == "train" else ["forward"]
        assert [n for n in inner if n in want] == want, (mode, attrs.get("training.step"), inner)
        seen[mode] += 1
    assert seen == {"train": timm_on_gpu.truth["train_steps"], "eval": timm_on_gpu.truth["eval_steps"]}, seen


@pytest.mark.parametrize("name", sorted(RUNS))
def test_timing_mode_is_the_one_asked(gpu_runs, name):
    modes = {a.get("training.timing") for a in gpu_runs(name).roots}
    assert modes == {RUNS[name]["OTEL_TRAINING_GPU_TIMING"]}, f"training.timing on the step spans: {modes}"


def _steps_with_children(loop):
    by_parent: dict = {}
    for name, sid, parent, start, end, attrs in loop.spans:
        by_parent.setdefault(parent, []).append((name, start, end, attrs))
    for name, sid, parent, start, end, attrs in loop.spans:
        if name == "step" and not parent:
            yield (start, end, attrs), by_parent.get(sid, [])


def test_phases_add_up_to_every_step(loop):
    n = 0
    for (start, end, attrs), children in _steps_with_children(loop):
        covered = sum(e - s for _, s, e, _ in children)
        untracked = attrs.get("training.untracked.duration", 0.0) * 1e9
        assert abs(covered + untracked - (end - start)) < 2_000 * (1 + len(children)), (
            f"step {attrs.get('training.step')} ({attrs.get('training.mode')}): phases {covered / 1e6:.3f} ms + "
            f"untracked {untracked / 1e6:.3f} ms != step {(end - start) / 1e6:.3f} ms")
        for name, s, e, _ in children:
            assert start <= s <= e <= end, f"{name} lies outside its step"
        n += 1
    assert n == len(loop.roots) > 0


def test_gpu_idle_of_the_log_line_lands_on_untracked(gpu_runs):
    loop = gpu_runs("events")
    truth, summary = suite._truth(loop), suite._summary(loop)
    idle = suite._get(summary, "modes.train.gpu_idle_s")
    untracked = sum(v for k, v in idle.items() if "untracked" in k)
    planted = truth["planted_total_s"]["train"]["untracked"]
    assert untracked >= 0.9 * planted, f"GPU idle by phase {idle}; the log line slept {planted:.3f} s in all"


def _phase_means(summary, mode="train"):
    phases = suite._get(summary, f"modes.{mode}.phases")
    return {f"{p.get('parent')}/{p['name']}": p["total_s"] / p["count"] for p in phases if p.get("count")}


def test_flops_and_mfu_agree_with_nanogpt(gpu_runs):
    """FLOPs per step against nanoGPT's analytic count (6N + 12LHQT per token), and MFU
    against ``estimate_mfu`` over the time the script measured for the same steps: the
    training part of every iteration after the first (ours counts from the step after
    warm-up and leaves the evaluations to eval steps; nanoGPT's own running figure skips
    five iterations and keeps the evaluations in its ``dt``, so it is printed only).
    Eager only: FLOPs of compiled modules are not counted (docs/telemetry.md)."""
    loop = gpu_runs("events")
    truth, summary = suite._truth(loop), suite._summary(loop)
    notes = truth["notes"]
    flops = suite._get(summary, "modes.train.flops")
    assert flops["dtype"] == "bf16", flops
    assert flops["per_step"] == pytest.approx(notes["flops_per_iter"], rel=NANOGPT_AGREE), flops
    assert flops["peak_flop_s"], f"no peak for {flops['device']}"
    expected = notes["flops_per_iter"] / notes["train_iter_s"] / flops["peak_flop_s"]
    running = notes["flops_per_iter"] / notes["mean_iter_s"] / flops["peak_flop_s"]
    print(f"our MFU {flops['mfu']:.4f}; estimate_mfu over the same steps {expected:.4f}, nanoGPT's running "
          f"figure {running:.4f} (per step {flops['per_step']:.3e} vs {notes['flops_per_iter']:.3e}; {flops['device']})")
    assert flops["mfu"] == pytest.approx(expected, rel=NANOGPT_AGREE), (flops, notes)


def test_the_run_exports_real_gauges_of_its_gpu(gpu_runs):
    pynvml = pytest.importorskip("pynvml")
    loop = gpu_runs("events")
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        uuid, total = pynvml.nvmlDeviceGetUUID(handle), pynvml.nvmlDeviceGetMemoryInfo(handle).total
    finally:
        pynvml.nvmlShutdown()
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    g = loop.gauges
    for name in ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.power.draw"):
        assert any(a.get("hw.id") == uuid for a, _ in g.get(name, [])), f"no {name} for {uuid}: {sorted(g)}"
    mine = {name: next(v for a, v in g[name] if a.get("hw.id") == uuid) for name in
            ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.power.draw")}
    assert mine["hw.gpu.memory.limit"] == total
    assert 0.0 < mine["hw.gpu.utilization"] <= 1.0, mine  # it trained on that GPU during the window
    assert 0 < mine["hw.gpu.memory.usage"] <= total and mine["hw.gpu.power.draw"] > 0, mine
    for name in ("hw.gpu.utilization", "hw.gpu.memory.usage"):
        for attrs, _ in g[name]:
            assert attrs.get("host.name") and attrs.get("hw.model") and "gpu.index" in attrs, attrs
