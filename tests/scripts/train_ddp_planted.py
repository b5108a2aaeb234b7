"""A CPU training loop for ``torchrun`` (gloo), DDP or FSDP2, with one delay planted,
for tests/test_grad_sync.py. Plain PyTorch, no OpenTelemetry.

``--plant``:
  loader     rank ``--plant-rank``'s dataset sleeps ``--plant-ms`` per batch
  backward   rank ``--plant-rank``'s backward sleeps (a gradient hook on the first layer), from
             step ``--plant-from`` on
  allreduce  every rank's gradient all-reduce completes ``--plant-ms`` late (a comm hook)
  none       nothing planted
Every rank's forward sleeps ``--base-ms`` (its compute). ``--fsdp``: ``fully_shard``
instead of DDP. ``--backend nccl``: one GPU per rank (docs/distributed.md).
"""

import argparse
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Batches(Dataset):
    """Whole batches; a slow one sleeps per batch (a slow disk or decode)."""

    def __init__(self, n: int, batch: int, sleep_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, batch, 64, generator=g)
        self.y = torch.randint(0, 4, (n, batch), generator=g)
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.x[i], self.y[i]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--plant", choices=("loader", "backward", "allreduce", "none"), default="none")
    p.add_argument("--plant-rank", type=int, default=1)
    p.add_argument("--plant-ms", type=float, default=80.0)
    p.add_argument("--base-ms", type=float, default=30.0, help="every rank's forward sleeps this long (compute)")
    p.add_argument("--plant-from", type=int, default=0, help="backward: the step the plant starts at (a rank turning slow)")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="nccl: one GPU per rank")
    args = p.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    delay = args.plant_ms / 1e3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4)).to(device)
    base = args.base_ms / 1e3
    model.register_forward_pre_hook(lambda m, a: time.sleep(base))  # the same compute on every rank
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model)
        net = model
    else:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        if args.plant == "allreduce":

            def slow_allreduce(state, bucket):
                # A slower network: the bucket's future completes ``delay`` after its
                # all-reduce, from a thread of the script's own (no Python callback
                # sleeping in one of gloo's threads, which its collectives need).
                work = dist.all_reduce(bucket.buffer().div_(world), async_op=True)
                fut = torch.futures.Future()

                def late():
                    time.sleep(delay)
                    work.wait()
                    fut.set_result(bucket.buffer())

                threading.Thread(target=late, daemon=True).start()
                return fut

            net.register_comm_hook(None, slow_allreduce)
    done = [0]  # steps taken
    if args.plant == "backward" and rank == args.plant_rank:
        # More backward compute (from --plant-from on).
        model[0].weight.register_hook(lambda g: time.sleep(delay) if done[0] >= args.plant_from else None)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    slow_loader = args.plant == "loader" and rank == args.plant_rank
    loader = DataLoader(Batches(args.steps, 16, delay if slow_loader else 0.0), batch_size=None)
    steps = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = loss_fn(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        done[0] = steps
    dist.barrier()
    print(f"RANK {rank} STEPS {steps} PID {os.getpid()}", flush=True)
    # Let gloo's thread drop the barrier's work (it needs the GIL) before the process
    # group goes: torch's ProcessGroupGloo destructor joins that thread with the GIL
    # held, and a work whose thread-local state holds a Python object then deadlocks
    # it at exit (seen twice in 7 CI runs of this script).
    time.sleep(0.5)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
