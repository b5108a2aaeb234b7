"""DDP's per-step cost of otel-training: two gloo ranks on the CPU under ``torchrun``,
plain against instrumented (``--no-python opentelemetry-instrument``), side by side.

Each round runs every variant once, in a rotating order, so the machine's drift falls
on all alike. A variant is a whole ``torchrun`` job; rank 0 times its own steps after
a warm-up (``time.perf_counter`` around each step) and prints the median. Printed per
variant: the median over rounds of the per-step median, and the difference to plain.
``--base DIR`` adds a variant instrumented with the otel_training package in DIR (an
older checkout: ``git archive REV otel_training | tar -x -C DIR``), so the cost a
change adds shows against the cost before it. Exports are off (``none``): this is the
instrumentation's cost, not the exporters'.

    .venv/bin/python benchmarks/ddp_overhead.py [--rounds 5] [--steps 300] [--base DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_BIN = os.path.dirname(sys.executable)


def worker(steps: int, warmup: int, width: int) -> None:
    """One rank: DDP over a small MLP, ~10 ms a step on one core."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(width, width), nn.ReLU())], nn.Linear(width, 8))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(64 * 8, width), torch.randint(0, 8, (64 * 8,)))
    loader = torch.utils.data.DataLoader(data, batch_size=64)
    times = []
    done = 0
    while done < steps + warmup:
        for x, y in loader:
            t0 = time.perf_counter()
            loss = nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            done += 1
            if done >= steps + warmup:
                break
    dist.barrier()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"median_ms": statistics.median(times[warmup:]) * 1e3}), flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(variant: str, args: argparse.Namespace) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "PYTHONPATH"}
    env.update(
        OTEL_PYTHON_DISTRO="otel_training",
        OTEL_PYTHON_CONFIGURATOR="otel_training",
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_TRAINING_HARDWARE="false",
        OTEL_TRAINING_SUMMARY="false",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONPATH=args.base if variant == "base" else _ROOT,
    )
    me = [os.path.join(_BIN, "python"), os.path.abspath(__file__), "--worker", "--steps", str(args.steps),
          "--width", str(args.width)]  # fmt: skip
    launch = [os.path.join(_BIN, "torchrun"), "--nnodes=1", "--nproc_per_node=2", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{_free_port()}"]  # fmt: skip
    if variant == "plain":
        cmd = launch + ["--no-python"] + me
    else:
        cmd = launch + ["--no-python", os.path.join(_BIN, "opentelemetry-instrument")] + me
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["median_ms"]
    raise RuntimeError(f"{variant}: no result\n{out.stderr[-2000:]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--base", help="a directory holding an older otel_training package: a third variant")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.steps, 30, args.width)
        return
    variants = ["plain", "instrumented"] + (["base"] if args.base else [])
    got: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            got[v].append(_job(v, args))
        print(f"round {r + 1}: " + ", ".join(f"{v} {got[v][-1]:.2f} ms" for v in variants), flush=True)
    plain = statistics.median(got["plain"])
    for v in variants:
        med = statistics.median(got[v])
        print(f"{v:>12}: median step {med:.3f} ms  ({(med - plain) * 1e3:+.0f} µs vs plain)")
    if args.base:
        pairs = [a - b for a, b in zip(got["instrumented"], got["base"])]
        print(f"instrumented - base, paired per round: median {statistics.median(pairs) * 1e3:+.0f} µs per step")


if __name__ == "__main__":
    main()
