"""Python opcodes of otel-training per step, on the training thread and on the
pipeline thread, and the pipeline's CPU time per step: steadier stand-ins for
wall-clock timing on a noisy machine.

Counted with ``sys.settrace`` opcode events in frames of otel_training code, on the
``overhead.py`` kind of loop (DataLoader, MLP, cross-entropy, SGD, ``.item()``);
the pipeline's work is run on this thread (its thread left idle) so it can be
traced too. Compare two checkouts side by side:

    .venv/bin/python benchmarks/opcodes.py [--root CHECKOUT]
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="the checkout whose otel_training to count")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import importlib
    import os

    # The pipeline thread must not drain: its work is counted here instead.
    restructured = os.path.exists(os.path.join(args.root, "otel_training", "aggregate", "pipeline.py"))
    pipeline_mod = importlib.import_module("otel_training.aggregate.pipeline" if restructured
                                           else "otel_training.pipeline")  # (an older checkout's layout)
    pipeline_mod._POLL_S = 3600.0
    pipeline_mod._WAKE_AT = 10**9
    from tests.conftest import Instrumented

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    n = args.steps
    loader = DataLoader(TensorDataset(torch.randn(16 * (6 * n + 60), 32), torch.randint(0, 4, (16 * (6 * n + 60),))),
                        batch_size=16)
    count = [0]

    def local(frame, event, arg):
        if event == "opcode":
            count[0] += 1
        return local

    def tracer(frame, event, arg):
        if "otel_training" in frame.f_code.co_filename:
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            return local
        return None

    def step(it) -> None:
        x, y = next(it)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()

    with Instrumented(trace_every_n=100, trace_max_per_second=1000, trace_slow_factor=0) as tel:
        pipeline = tel.runtime.pipeline
        it = iter(loader)
        for _ in range(50):  # warm-up
            step(it)
        pipeline._drain(None)
        sys.settrace(tracer)
        for _ in range(n):
            step(it)
        sys.settrace(None)
        training = count[0] / n
        count[0] = 0
        sys.settrace(tracer)
        pipeline._drain(None)
        sys.settrace(None)
        print(f"{tel.runtime.summary_dict()['modes']['train']['steps']} steps")
        print(f"opcodes per step: training thread {training:.0f}, pipeline {count[0] / n:.0f}")
        cpu = []
        for _ in range(5):  # the pipeline's CPU time per step, its drain timed alone
            for _ in range(n):
                step(it)
            t0 = time.thread_time_ns()
            pipeline._drain(None)
            cpu.append((time.thread_time_ns() - t0) / n / 1e3)
        print(f"pipeline CPU per step: {sorted(cpu)[2]:.1f} us (median of 5 drains of {n} steps)")


if __name__ == "__main__":
    main()
