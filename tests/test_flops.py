"""FLOPs per training step and MFU: counted once on a real step of a nanoGPT-shaped
loop, checked against ``FlopCounterMode`` run independently on the same step and
against nanoGPT's analytic count (6N + 12LHQT per token); MFU from a given peak; the
peak table; the ways counting is given, turned off or skipped."""

from __future__ import annotations

import logging

import pytest
import torch

from otel_training.config import ConfigError, load_config
from otel_training.record import flops as flops_mod
from otel_training.record.peak_flops import peak_flops
from tests.fake_pynvml import fake_nvml  # noqa: F401 (fixture)
from tests.gpt_model import GPT, GPTConfig

CFG = GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64)
BATCH, ACCUM = 4, 2


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(CFG.vocab_size, (8192,), generator=g)


def _get_batch(data):
    ix = torch.randint(len(data) - CFG.block_size - 1, (BATCH,))
    x = torch.stack([data[i:i + CFG.block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + CFG.block_size] for i in ix])
    return x, y


def _iteration(model, opt, data):
    """One nanoGPT iteration: ACCUM micro-batches, clip, AdamW step."""
    for _ in range(ACCUM):
        x, y = _get_batch(data)
        _, loss = model(x, y)
        (loss / ACCUM).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _nanogpt_run(tel, iters=8):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _data()
    for _ in range(iters):
        _iteration(model, opt, data)
    tel.uninstrument()
    return model, opt, data, tel.runtime.summary_dict()["modes"]["train"]


def _independent_count(model, opt, data) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        _iteration(model, opt, data)
    return counter.get_total_flops()


def test_flops_per_step_match_flop_counter_and_the_nanogpt_formula(instrumented):
    tel = instrumented()
    model, opt, data, train = _nanogpt_run(tel)
    f = train["flops"]
    assert f["source"] == "measured" and f["device"] == "cpu" and f["dtype"] == "fp32"
    independent = _independent_count(model, opt, data)
    assert f["per_step"] == pytest.approx(independent, rel=0.05)
    analytic = model.flops_per_iter(BATCH * ACCUM)
    assert f["per_step"] == pytest.approx(analytic, rel=0.10)
    # counted from the step after warm-up on: every later training step has them
    counted_steps = train["steps"] - flops_mod.WARMUP
    assert f["total"] == pytest.approx(f["per_step"] * counted_steps)
    counter = sum(p.value for p in tel.points("training.flops", {"training.mode": "train"}))
    assert counter == pytest.approx(f["total"])
    assert f["flop_s"] > 0 and f["count_cost_s"] is not None and f["count_cost_s"] >= 0
    # CPU: no peak known, so FLOP/s but no MFU
    assert f["peak_flop_s"] is None and f["mfu"] is None
    assert not tel.points("training.mfu")
    # the probe left the step path once done: steps go straight to the pipeline
    runtime = tel.runtime
    assert runtime.measures.probe.done and runtime.tracker.assembler._sink == runtime.pipeline.submit


def test_mfu_from_a_given_peak(instrumented):
    tel = instrumented(peak_flops=2e11)
    _, _, _, train = _nanogpt_run(tel)
    f = train["flops"]
    assert f["peak_flop_s"] == 2e11
    assert f["mfu"] == pytest.approx(f["flop_s"] / 2e11)
    (point,) = tel.points("training.mfu", {"training.mode": "train"})  # one window: every counted step
    assert point.value == pytest.approx(f["mfu"], rel=1e-6)
    from otel_training.diagnosis.summary_text import render_summary

    summary = tel.runtime.summary_dict()
    assert f"MFU {100 * f['mfu']:.1f}%" in render_summary(summary)


def test_the_report_shows_throughput_and_compute(instrumented, tmp_path, capsys):
    """``otel-training report --summary``: tokens/s beside samples/s, FLOP/s and MFU."""
    import json

    from otel_training.cli.report import main

    tel = instrumented(peak_flops=2e11)
    _nanogpt_run(tel)
    summary = tel.runtime.summary_dict()
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary, default=str))
    assert main(["--summary", str(path)]) == 0
    out = capsys.readouterr().out
    train = summary["modes"]["train"]
    assert f"{train['tokens_per_s']:,.0f} tokens/s" in out  # over the train steps' own time
    assert f"MFU {100 * train['flops']['mfu']:.1f}% of 200 GFLOP/s (fp32, cpu)" in out


def test_flops_per_step_given_and_turned_off(instrumented):
    tel = instrumented(flops_per_step=5e9, peak_flops=1e12)
    _, _, _, train = _nanogpt_run(tel, iters=4)
    f = train["flops"]
    assert f["source"] == "OTEL_TRAINING_FLOPS_PER_STEP" and f["per_step"] == 5e9
    assert f["total"] == 5e9 * train["steps"]  # known from the first training step
    assert f["count_cost_s"] is None
    tel.close()

    off = instrumented(flops_per_step=0)
    _, _, _, train = _nanogpt_run(off, iters=4)
    assert "flops" not in train and not off.points("training.flops")
    assert off.runtime.measures.probe is None


def test_a_compiled_model_is_not_counted_with_one_log_line(instrumented, caplog):
    pytest.importorskip("torch._dynamo")
    tel = instrumented()
    torch.manual_seed(0)
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
                          backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="otel_training"):
        for _ in range(6):
            torch.nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 2, (8,))).backward()
            opt.step()
            opt.zero_grad()
        tel.uninstrument()
    lines = [r.getMessage() for r in caplog.records if "FLOPs" in r.getMessage()]
    assert lines == ["otel-training: FLOPs per step not counted: compiled modules run "
                     "(set OTEL_TRAINING_FLOPS_PER_STEP to give the count)"]
    assert "flops" not in tel.runtime.summary_dict()["modes"]["train"]


def _train_then_validate(inference_mode_around_the_loop: bool, epochs: int = 3) -> list:
    """3 training steps an epoch over a DataLoader, then a timm-style validate:
    ``loss.data`` under ``torch.inference_mode()`` (around the eval loop, as timm's
    validate; or inside it, per batch). The eval losses are returned."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(TensorDataset(torch.randn(24, 8), torch.randint(3, (24,))), batch_size=8)
    evals = DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(3, (16,))), batch_size=8)
    losses: list = []

    def eval_batch(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        reduced = loss.data  # torch < 2.5 raised here under a dispatch mode
        assert reduced.is_inference()
        losses.append(reduced.item())

    for _ in range(epochs):
        model.train()
        for x, y in train:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        if inference_mode_around_the_loop:
            with torch.inference_mode():
                for x, y in evals:
                    eval_batch(x, y)
        else:
            for x, y in evals:
                with torch.inference_mode():
                    eval_batch(x, y)
        torch.randn(())  # an op without tensor arguments: no dispatch key left on
    return losses


@pytest.mark.parametrize("around", [True, False], ids=["inference_mode_around_the_loop", "inside_the_loop"])
def test_the_count_stays_out_of_inference_mode(instrumented, around):
    """The count's dispatch mode never runs under ``torch.inference_mode()``: on torch
    < 2.5 ``Tensor.data`` of an inference tensor raised under it (timm's validate,
    ``around``); on any torch a count begun outside inference mode and ended inside it
    left the Python dispatch key on (an internal assert at the next op, ``inside``).
    The first window after warm-up is an eval step: a later training step is counted."""
    enter = torch.inference_mode.__dict__["__enter__"]
    plain = _train_then_validate(around)
    tel = instrumented()
    losses = _train_then_validate(around)
    tel.uninstrument()
    assert losses == plain  # the user's results, unchanged
    f = tel.runtime.summary_dict()["modes"]["train"]["flops"]
    # forward and weight gradients 2 x 2 x 8 x (8x16 + 16x3), the second layer's input gradient 2 x 8 x 16x3
    assert f["source"] == "measured" and f["per_step"] == 4 * 8 * (8 * 16 + 16 * 3) + 2 * 8 * 16 * 3
    assert f["counted_step"] > flops_mod.WARMUP - 1  # not the step right after warm-up (an eval step)
    assert torch.inference_mode.__dict__["__enter__"] is enter  # the guard is gone


def test_training_steps_that_enter_inference_mode_are_not_counted_with_one_log_line(instrumented, caplog):
    """Every training step computes its accuracy under ``torch.inference_mode()``: each
    count ends there, uncounted, and after its tries the probe gives up with one line;
    the loop runs on, its results unchanged, and the probe has left the step path."""
    enter = torch.inference_mode.__dict__["__enter__"]

    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        accuracies = []
        for _ in range(flops_mod.WARMUP + flops_mod.MAX_TRIES + 3):
            x, y = torch.randn(8, 8), torch.randint(3, (8,))
            out = model(x)
            torch.nn.functional.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()
            with torch.inference_mode():
                accuracies.append((out.argmax(1) == y).float().mean().data.item())
        return accuracies

    plain = run()
    tel = instrumented()
    with caplog.at_level(logging.WARNING, logger="otel_training"):
        assert run() == plain
        tel.uninstrument()
    lines = [r.getMessage() for r in caplog.records if "FLOPs" in r.getMessage()]
    assert lines == ["otel-training: FLOPs per step not counted: training steps run in torch.inference_mode() "
                     "(set OTEL_TRAINING_FLOPS_PER_STEP to give the count)"]
    assert "flops" not in tel.runtime.summary_dict()["modes"]["train"]
    assert tel.runtime.measures.probe.done and torch.inference_mode.__dict__["__enter__"] is enter


@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12),
    ("NVIDIA H100 PCIe", "bf16", 756.5e12),
    ("NVIDIA H100 NVL", "tf32", 417.5e12),
    ("NVIDIA H200", "bf16", 989.5e12),
    ("NVIDIA H200 NVL", "fp16", 835.5e12),
    ("NVIDIA GH200 480GB", "bf16", 989.5e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100 80GB PCIe", "tf32", 156e12),
    ("NVIDIA A10", "bf16", 125e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA L40S", "bf16", 366.5e12),
    ("NVIDIA L40", "fp16", 181e12),
    ("NVIDIA B200", "bf16", 2250e12),
    ("Tesla V100-SXM2-16GB", "fp16", 125e12),
    ("Tesla V100-PCIE-32GB", "fp16", 112e12),
    ("Tesla T4", "fp32", 8.1e12),
    ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores
    ("NVIDIA GeForce GTX 1080", "fp32", None),  # not in the table
    ("NVIDIA H100 80GB HBM3", "fp64", None),
])
def test_peak_table(name, dtype, expected):
    assert peak_flops(name, dtype) == expected


def test_peak_table_names_as_nvml_reports_them(fake_nvml):  # noqa: F811
    """The fake NVML's default GPU name (as nvmlDeviceGetName returns it) is found."""
    import pynvml

    pynvml.nvmlInit()
    name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    assert peak_flops(name, "bf16") == 989.5e12


@pytest.mark.parametrize("var, raw", [
    ("OTEL_TRAINING_FLOPS_PER_STEP", "-1"),
    ("OTEL_TRAINING_FLOPS_PER_STEP", "lots"),
    ("OTEL_TRAINING_PEAK_FLOPS", "0"),
    ("OTEL_TRAINING_PEAK_FLOPS", "989 TFLOPS"),
    ("OTEL_TRAINING_MEMORY", "maybe"),
])
def test_config_errors_name_the_variable_and_the_accepted_values(var, raw):
    with pytest.raises(ConfigError) as err:
        load_config({var: raw})
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{var}={raw!r} is not valid: use ")


def test_config_values():
    c = load_config({"OTEL_TRAINING_FLOPS_PER_STEP": "6.2e12", "OTEL_TRAINING_PEAK_FLOPS": "989e12",
                     "OTEL_TRAINING_MEMORY": "false"})
    assert (c.flops_per_step, c.peak_flops, c.memory) == (6.2e12, 989e12, False)
    assert load_config({"OTEL_TRAINING_FLOPS_PER_STEP": "0"}).flops_per_step == 0
    d = load_config({})
    assert (d.flops_per_step, d.peak_flops, d.memory) == (None, None, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_count_picks_the_bf16_peak(instrumented):
    tel = instrumented(gpu_timing="events")
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _data().cuda()
    for _ in range(8):
        for _ in range(ACCUM):
            x, y = _get_batch(data)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
            (loss / ACCUM).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tel.uninstrument()
    f = tel.runtime.summary_dict()["modes"]["train"]["flops"]
    assert f["dtype"] == "bf16" and f["device"] == torch.cuda.get_device_name()
    assert f["per_step"] == pytest.approx(model.flops_per_iter(BATCH * ACCUM), rel=0.10)
    expected_peak = peak_flops(torch.cuda.get_device_name(), "bf16")
    assert f["peak_flop_s"] == expected_peak
    if expected_peak:
        assert 0 < f["mfu"] < 1
