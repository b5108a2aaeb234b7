"""Ranks started with ``torch.multiprocessing.spawn`` (no torchrun), each training a
few steps with a spawned DataLoader worker. No OpenTelemetry in here.

``--report DIR``: the DataLoader worker writes what it sees there (its threads, which
otel-training and SDK modules are loaded) as ``worker-<pid>.json``."""

import argparse
import json
import os
import sys
import threading

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

STEPS = 6


def _report_worker(report: str, worker_id: int) -> None:
    record = {
        "pid": os.getpid(), "ppid": os.getppid(),
        "all_threads": sorted(t.name for t in threading.enumerate()),
        "otel_training_modules": sorted(m for m in sys.modules if m.startswith("otel_training")),
        "sdk_loaded": sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")),
    }
    with open(os.path.join(report, f"worker-{os.getpid()}.json"), "w") as fh:
        json.dump(record, fh)


class _InitFn:
    def __init__(self, report: str) -> None:
        self.report = report

    def __call__(self, worker_id: int) -> None:
        if self.report:
            _report_worker(self.report, worker_id)


def rank_main(index: int, report: str = "") -> None:
    torch.manual_seed(index)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(STEPS * 4, 8), torch.randint(0, 2, (STEPS * 4,)))
    loader = DataLoader(data, batch_size=4, num_workers=1, multiprocessing_context="spawn",
                        worker_init_fn=_InitFn(report))
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"RANK_PID {os.getpid()}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--report", default="")
    args = p.parse_args()
    mp.spawn(rank_main, args=(args.report,), nprocs=1)
    print(f"PARENT_PID {os.getpid()}", flush=True)
    sys.exit(0)
