"""A plain loop that checkpoints with torch.save every few steps and, in its first
attempt under torchrun (``TORCHELASTIC_RESTART_COUNT=0``), fails after a checkpoint on
rank ``--fail-rank``, while the other ranks wait there (as for a collective) until
torchrun stops them; the next attempt resumes from the checkpoint and finishes. No
otel-training import (but with ``--tell-global-step``: ``otel_training.global_step``).

Writes its own clock per attempt and rank to ``<dir>/attempt-<n>-rank<r>.json``
(wall-clock seconds): the script's first line, its first step, the failure (or the
wait), the end."""

import time

FIRST_LINE = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--every", type=int, default=10)
p.add_argument("--fail-at", type=int, default=25)
p.add_argument("--step-ms", type=float, default=20.0)
p.add_argument("--fail-rank", type=int, default=0)
p.add_argument("--tell-global-step", action="store_true")
p.add_argument("--kill", action="store_true", help="fail by SIGKILL (as the OOM killer does), not an exception")
p.add_argument("--dir", required=True)
args = p.parse_args()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))
if attempt < 0:  # no torchrun: a rerun is the next attempt (the first one left its clock)
    attempt = int(os.path.exists(os.path.join(args.dir, f"attempt-0-rank{os.environ.get('RANK', '0')}.json")))
rank = int(os.environ.get("RANK", "0"))
clock = {"first_line": FIRST_LINE, "save_end": {}}


def save_clock():
    with open(os.path.join(args.dir, f"attempt-{attempt}-rank{rank}.json"), "w") as fh:
        json.dump(clock, fh)


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4)
ckpt = os.path.join(args.dir, f"ckpt-{rank}.pt")
step = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
if args.tell_global_step:
    import otel_training

    otel_training.global_step(lambda: step)
while step < args.steps:
    for x, y in loader:
        if "first_step" not in clock:
            clock["first_step"] = time.time()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_ms / 1e3)
        step += 1
        if step % args.every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
            clock["save_end"][step] = time.time()
        if attempt == 0 and step == args.fail_at:
            clock["failed"] = time.time()
            save_clock()
            if rank == args.fail_rank:
                # As a collective would, the failure waits until every rank is at this
                # step (each has left its clock): on a loaded machine a slower rank could
                # otherwise be stopped before it got here.
                world = int(os.environ.get("WORLD_SIZE", "1"))
                others = [os.path.join(args.dir, f"attempt-0-rank{r}.json") for r in range(world) if r != rank]
                deadline = time.time() + 120
                while not all(os.path.exists(o) for o in others) and time.time() < deadline:
                    time.sleep(0.05)
            if rank == args.fail_rank and args.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == args.fail_rank:
                raise RuntimeError(f"planted failure at step {step}")
            time.sleep(120)  # waits for the failed rank until torchrun stops this one
        if step >= args.steps:
            break
clock["end"] = time.time()
save_clock()
