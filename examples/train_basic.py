"""A plain PyTorch training loop with no OpenTelemetry in it.

Run it instrumented, with no code change:

    opentelemetry-instrument --service_name basic python examples/train_basic.py

``--batch-delay-ms`` plants a slow dataset (sleep per batch) and ``--log-delay-ms``
a slow logging call in user code, so their cost can be seen in the telemetry. Under
``torchrun`` with several ranks the model is a ``DistributedDataParallel`` (gloo):
each rank trains on its shard and the gradients are all-reduced every step.
"""

import argparse
import json
import os
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


def _sleep(seconds: float) -> float:
    start = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - start


class Synthetic(Dataset):
    def __init__(self, n: int, delay_s: float, batch_size: int) -> None:
        self.n, self.delay_s, self.batch_size = n, delay_s, batch_size
        self.slept = []  # seconds actually slept, to compare with the telemetry

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i % self.batch_size == 0:  # one sleep per batch (sequential sampler)
            self.slept.append(_sleep(self.delay_s))
        return torch.randn(32), i % 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--batch-delay-ms", type=float, default=20.0)
    parser.add_argument("--log-delay-ms", type=float, default=5.0)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    loss_fn = nn.CrossEntropyLoss()
    data = Synthetic(args.steps * args.batch_size, args.batch_delay_ms / 1e3, args.batch_size)
    loader = DataLoader(data, batch_size=args.batch_size)
    logged = []
    waited = []  # seconds the loop waited for each batch: next() as the loop saw it
    for _ in range(args.epochs):
        end = time.perf_counter()  # the first wait also starts the iterator
        for x, y in loader:
            waited.append(time.perf_counter() - end)
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            logged.append(_sleep(args.log_delay_ms / 1e3))  # a slow logger
            _ = loss.item()
            end = time.perf_counter()
    # The delays as they really happened (sleep overshoots on a busy machine), and the
    # loop's waits for its batches (each sleep with the rest of its fetch).
    print(json.dumps({"batch_delay_ms": statistics.median(data.slept) * 1e3,
                      "wait_ms": [w * 1e3 for w in waited],
                      "log_delay_ms": statistics.median(logged) * 1e3}))
    if distributed:
        dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
