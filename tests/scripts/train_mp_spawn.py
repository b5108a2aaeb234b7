"""Ranks started with ``torch.multiprocessing.spawn`` (no torchrun), each training a
few steps with a spawned DataLoader worker. No OpenTelemetry in here."""

import os
import sys

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

STEPS = 6


def rank_main(index: int) -> None:
    torch.manual_seed(index)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(STEPS * 4, 8), torch.randint(0, 2, (STEPS * 4,)))
    loader = DataLoader(data, batch_size=4, num_workers=1, multiprocessing_context="spawn")
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"RANK_PID {os.getpid()}", flush=True)


if __name__ == "__main__":
    mp.spawn(rank_main, nprocs=1)
    print(f"PARENT_PID {os.getpid()}", flush=True)
    sys.exit(0)
