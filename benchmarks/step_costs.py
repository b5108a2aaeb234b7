"""Micro-costs of the per-step work for throughput, FLOPs and memory.

Each call timed alone with ``timeit`` (best of 5 repeats, µs per call), and the
one-off FLOP count of a ~1 ms step and of a small GPT step. Opcodes per step:
``benchmarks/opcodes.py``.

    .venv/bin/python benchmarks/step_costs.py
"""

from __future__ import annotations

import statistics
import sys
import time
import timeit

import torch

torch.set_num_threads(1)


def _us(stmt, number=20000) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=5)) / number * 1e6


def calls() -> None:
    from otel_training.record import batches
    from otel_training.record.timeline import StepTimeline

    x, y = torch.randn(64, 256), torch.randint(0, 4, (64,))
    ids = torch.randint(0, 50000, (8, 512))
    mask = torch.ones(8, 512, dtype=torch.long)
    step = StepTimeline(-1, None)

    def fresh():
        step.batch_size = None
        if hasattr(step, "token_count"):  # (an older checkout has no token fields)
            step.token_count = step.token_masks = None

    def row(what, stmt, number=20000):
        print(f"{what:<44}{_us(stmt, number):6.2f} µs")

    if hasattr(batches, "read_batch"):
        hf = {"input_ids": ids, "attention_mask": mask, "labels": ids}
        row("read_batch, (x float, y) batch:", lambda: (fresh(), batches.read_batch([x, y], step)))
        row("read_batch, (ids, targets) token batch:", lambda: (fresh(), batches.read_batch([ids, ids], step)))
        row("read_batch, dict with attention_mask:", lambda: (fresh(), batches.read_batch(hf, step)))
        row("read_inputs, model(x, y) (no DataLoader):", lambda: (fresh(), batches.read_inputs((ids, ids), {}, step)))
        row("mask_tokens (pipeline), 8 x 512 mask:", lambda: batches.mask_tokens([mask]), 2000)
    row("infer_batch_size, (x float, y) batch:", lambda: (fresh(), batches.infer_batch_size([x, y])))
    row("StepTimeline(): a new step's record:", lambda: StepTimeline(-1, None))
    try:
        from otel_training.record.memory import MemoryReader
    except ImportError:
        return
    reader = MemoryReader()
    row("MemoryReader.read (RSS, /proc/self/statm):", lambda: reader.read(0), 5000)
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        cuda_reader = MemoryReader()
        row("MemoryReader.read (CUDA allocator stats):", lambda: cuda_reader.read(0), 2000)


def _flop_count(name, model, batch, loss_of, steps=12) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from otel_training import runtime
    from otel_training.instrumentor import TrainingInstrumentor

    inst = TrainingInstrumentor()
    inst.instrument(tracer_provider=TracerProvider(), meter_provider=MeterProvider())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    durations = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for b in batch():
            loss_of(model, b).backward()
        opt.step()
        opt.zero_grad()
        durations.append(time.perf_counter() - t0)
    rt = runtime.current()
    inst.uninstrument()
    f = rt.summary_dict()["modes"]["train"].get("flops")
    if f is None:
        print(f"{name}: no FLOP count")
        return
    print(f"{name}: step {statistics.median(durations) * 1e3:.2f} ms, FLOPs per step {f['per_step']:.3g}, "
          f"the counted step +{f['count_cost_s'] * 1e3:.1f} ms (one-off)")


def flop_counts() -> None:
    if "otel_training.record.flops" not in sys.modules:
        try:
            import otel_training.record.flops  # noqa: F401
        except ImportError:
            return
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*layers, torch.nn.Linear(256, 4))
    x, y = torch.randn(64, 256), torch.randint(0, 4, (64,))
    _flop_count("~1 ms MLP step (overhead.py)", mlp, lambda: [(x, y)],
                lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    sys.path.insert(0, ".")
    from tests.gpt_model import GPT, GPTConfig

    cfg = GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64)
    ids = torch.randint(0, 256, (4, 64))
    _flop_count("GPT (2 layers, 64 wide, 4 x 64 tokens, 2 micro-batches)", GPT(cfg), lambda: [(ids, ids)] * 2,
                lambda m, b: m(b[0], b[1])[1])


if __name__ == "__main__":
    calls()
    flop_counts()
