"""Two DDP ranks started with ``torch.multiprocessing.spawn``: the children see only
``MASTER_ADDR``/``MASTER_PORT`` (set by the parent) and get their rank as an argument,
which they pass to ``init_process_group`` (gloo). No OpenTelemetry in here.

Each rank prints ``RANK_OF <pid> <rank> <world size>``: the truth to compare with."""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

WORLD = 2


def rank_main(index: int, steps: int) -> None:
    # A peer that died fails the other fast instead of gloo's 30-minute wait.
    dist.init_process_group("gloo", rank=index, world_size=WORLD, timeout=timedelta(seconds=60))
    torch.manual_seed(index)
    model = DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(steps * 4, 8), torch.randint(0, 2, (steps * 4,)))
    for x, y in DataLoader(data, batch_size=4):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # One write of the whole line: the ranks share stdout, and print() writes the newline apart.
    os.write(1, f"RANK_OF {os.getpid()} {dist.get_rank()} {dist.get_world_size()}\n".encode())
    dist.barrier()
    # As in train_ddp_planted.py: let gloo's thread drop the last work (it needs the GIL)
    # before the process group goes; ProcessGroupGloo's destructor joins that thread with
    # the GIL held, and a work holding a Python object then deadlocks the exit.
    time.sleep(0.5)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--port", required=True)
    args = p.parse_args()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    mp.spawn(rank_main, args=(args.steps,), nprocs=WORLD)
