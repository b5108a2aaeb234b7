"""nanoGPT's loop shape (``while True: ... break``, no DataLoader, a log line after each
update), followed by exit-time work that a library registered with ``atexit`` after the
instrumentation did -- as ``torch.compile``'s compile-worker pool or a logger's final
flush do -- so it runs before our own ``atexit`` handler.

    exit_work.py [--exit-work-s S] [--thread]

``--thread``: the loop runs on a non-daemon thread that the main thread does not join
once it has begun (the interpreter joins it at exit). Prints ``LOOP {json}`` with the steps it took and
the loop's wall time."""

import argparse
import atexit
import json
import threading
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--exit-work-s", type=float, default=0.5)
parser.add_argument("--thread", action="store_true")
parser.add_argument("--iters", type=int, default=6)
args = parser.parse_args()

LOG_DELAY = 0.01
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
atexit.register(time.sleep, args.exit_work_s)


started = threading.Event()


def train() -> None:
    iter_num = 0
    t0 = time.perf_counter()
    while True:
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        started.set()
        time.sleep(LOG_DELAY)  # print(f"iter {iter_num}: loss {loss.item():.4f}")
        iter_num += 1
        if iter_num >= args.iters:
            break
    print("LOOP " + json.dumps({"steps": iter_num, "loop_s": time.perf_counter() - t0}), flush=True)


if args.thread:
    threading.Thread(target=train, name="trainer").start()
    started.wait()  # not joined: the interpreter joins it at exit
else:
    train()
