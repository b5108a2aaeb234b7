"""DataLoader workers started with fork, spawn and forkserver (for the reliability tests).

One plain training loop per start method, two epochs each. Every worker writes what
it sees to ``--report`` (one JSON file per worker process): its threads (after giving
any exporter/sampler thread up to 3 s to stop), whether otel-training is active in
it, which of its modules and of the SDK's are loaded, and the global providers' types;
each item also calls a tensor method our hooks wrap. No OpenTelemetry in here (what is
looked at is only looked at if something else imported it).
"""

import argparse
import json
import os
import sys
import threading
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

_OURS = ("otel", "Otel")  # otel-training's threads and the SDK's export threads


def _our_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(_OURS))


def _provider_type(module: str, getter: str):
    """The global provider's class name, or None if the API was never imported."""
    api = sys.modules.get(module)
    return type(getattr(api, getter)()).__name__ if api is not None else None


def _instrumentor_installed() -> bool:
    mod = sys.modules.get("otel_training.instrumentor")
    return bool(mod is not None and mod.TrainingInstrumentor().is_instrumented_by_opentelemetry)


class Reporting(Dataset):
    def __init__(self, n: int, report: str, method: str, width: int = 16) -> None:
        self.n, self.report, self.method, self.width = n, report, method, width
        self.reported = False

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.randn(self.width)
        _ = x.sum().item()  # wrapped by otel-training in the parent: must be inert here
        info = torch.utils.data.get_worker_info()
        if info is not None and not self.reported:
            self.reported = True
            deadline = time.monotonic() + 3.0
            while _our_threads() and time.monotonic() < deadline:
                time.sleep(0.02)
            runtime = sys.modules.get("otel_training.runtime.active")
            record = {
                "method": self.method, "pid": os.getpid(), "ppid": os.getppid(), "worker": info.id,
                "threads": _our_threads(),
                "all_threads": sorted(t.name for t in threading.enumerate()),
                "otel_training_loaded": runtime is not None,
                "otel_training_active": bool(runtime is not None and runtime.current() is not None),
                "otel_training_modules": sorted(m for m in sys.modules if m.startswith("otel_training")),
                "sdk_loaded": sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")),
                "tracer_provider": _provider_type("opentelemetry.trace", "get_tracer_provider"),
                "meter_provider": _provider_type("opentelemetry.metrics", "get_meter_provider"),
                "instrumentor_installed": _instrumentor_installed(),
            }
            with open(os.path.join(self.report, f"worker-{os.getpid()}.json"), "w") as fh:
                json.dump(record, fh)
        return x, i % 4


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--start-methods", default="fork:2,spawn:2,forkserver:2",
                   help="comma-separated METHOD:WORKERS")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--pin-memory", action="store_true")
    p.add_argument("--persistent", default="spawn",
                   help="comma-separated start methods whose workers are persistent (others are "
                        "re-created every epoch)")
    p.add_argument("--report", required=True)
    args = p.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    steps = 0
    for item in args.start_methods.split(","):
        method, _, workers = item.partition(":")
        loader = DataLoader(
            Reporting(args.batches * args.batch_size, args.report, method), batch_size=args.batch_size,
            num_workers=int(workers or 2), multiprocessing_context=method,
            persistent_workers=(method in args.persistent.split(",")), pin_memory=args.pin_memory)
        for _ in range(args.epochs):
            for x, y in loader:
                loss = loss_fn(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                _ = loss.item()
                steps += 1
        del loader
    print(f"STEPS {steps} PID {os.getpid()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
