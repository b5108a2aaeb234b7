"""A plain training loop that receives SIGTERM at the worst moment for us: while the
step it just finished is being closed (no OpenTelemetry in it).

After ``--steps K`` iterations it arms a one-shot trap on ``torch.cuda.is_initialized``,
which otel-training's step end calls (the memory reading, once per 10 ms at most:
each iteration sleeps 15 ms). The trap delivers SIGTERM to the main thread, whose
handler runs at the next bytecode: inside otel-training's own step-end code. The
trap is made of C callables, so no frame of this script is the innermost one.
Without otel-training nothing calls it, and the loop runs to its end.
"""

import argparse
import functools
import itertools
import signal
import threading
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64 * 16, 32), torch.randint(0, 4, (64 * 16,)))
    # C callables only (no Python frame of the script's own): the first call sends
    # SIGTERM and returns None, later calls return False (CUDA not initialized).
    trap = functools.partial(
        next, itertools.starmap(signal.pthread_kill, [(threading.main_thread().ident, signal.SIGTERM)]), False
    )

    step = 0
    for x, y in DataLoader(data, batch_size=16):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.015)
        step += 1
        if step == args.steps:
            torch.cuda.is_initialized = trap  # the next step end springs it
    print("NOT KILLED", flush=True)


if __name__ == "__main__":
    main()
