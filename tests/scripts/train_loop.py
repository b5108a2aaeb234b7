"""A small, unmodified PyTorch training loop for the reliability tests (no OpenTelemetry in it).

Prints ``TRAINING_START <epoch s>`` and ``TRAINING_END <epoch s> <wall s>`` on stdout, so a
test can tell how long the process took to exit after training ended. ``--ready-after K``
prints ``READY`` after K steps (a signal test sends its signal then); ``--steps 0`` trains
until killed, or until the file ``--until-file`` appears. ``--raise-at K`` raises ``UserError`` at step K (the user's own exception).
"""

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class UserError(RuntimeError):
    pass


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--sleep-ms", type=float, default=0.0, help="user code per step (a logger)")
    p.add_argument("--ready-after", type=int, default=-1)
    p.add_argument("--raise-at", type=int, default=-1)
    p.add_argument("--until-file", default=None)
    args = p.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    n = 256 * args.batch_size
    data = TensorDataset(torch.randn(n, args.width), torch.randint(0, 4, (n,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)

    print(f"TRAINING_START {time.time():.6f}", flush=True)
    start = time.perf_counter()
    step = 0
    while args.steps <= 0 or step < args.steps:
        for x, y in loader:
            if step == args.raise_at:
                raise UserError(f"user failure at step {step}")
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            _ = loss.item()
            if args.sleep_ms:
                time.sleep(args.sleep_ms / 1e3)
            step += 1
            if step == args.ready_after:
                print("READY", flush=True)
            if 0 < args.steps <= step or (args.until_file and os.path.exists(args.until_file)):
                break
        if args.until_file and os.path.exists(args.until_file):
            break
    wall = time.perf_counter() - start
    print(f"TRAINING_END {time.time():.6f} {wall:.6f} {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
