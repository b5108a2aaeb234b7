"""A two-rank CPU training loop for ``torchrun`` (gloo), for tests/test_distributed.py.

Plain PyTorch, no OpenTelemetry: each rank trains on its shard; every ``--sync-every``
steps the ranks average the loss with ``all_reduce`` and collect it with
``all_gather`` (metric reduction, as training scripts do for logging). Rank
``--slow-rank`` sleeps ``--slow-ms`` per step: a straggler.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--sync-every", type=int, default=5)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-ms", type=float, default=40.0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    n = args.steps * args.batch_size * world
    data = TensorDataset(torch.randn(n, 16), torch.randint(0, 4, (n,)))
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data, shuffle=False))
    steps = 0
    for step, (x, y) in enumerate(loader):
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == args.slow_rank:
            time.sleep(args.slow_ms / 1e3)  # this rank is slower than the others
        if (step + 1) % args.sync_every == 0:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            gathered = [torch.zeros_like(avg) for _ in range(world)]
            dist.all_gather(gathered, avg)
        steps += 1
    dist.barrier()
    print(f"RANK {rank} STEPS {steps} PID {os.getpid()}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
