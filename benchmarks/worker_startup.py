"""DataLoader worker start-up under ``opentelemetry-instrument``: spawn and forkserver.

A training loop whose 2 DataLoader workers are re-created every epoch
(``persistent_workers=False``) with the ``spawn`` start method (macOS's default, and a
common choice with CUDA), then the same with ``forkserver``. Each configuration runs as
a real process, side by side, alternating (the order rotates each round):

* plain: ``python benchmarks/worker_startup.py --workload METHOD``
* instrumented: ``opentelemetry-instrument python benchmarks/worker_startup.py --workload
  METHOD`` with ``OTEL_PYTHON_DISTRO=otel_training OTEL_PYTHON_CONFIGURATOR=otel_training``,
  the default configuration (hardware sampling on) and an OTLP/gRPC endpoint on a closed
  loopback port (``--live``: a real OTLP receiver in this process instead).

Three figures per run, medians over rounds:

* **loop**: the training loop's wall time, from the first epoch's ``iter(loader)`` to
  the end of the last epoch (the workers' start-up every epoch included). The target is
  on this one.
* **worker up**: per epoch, from ``iter(loader)`` until both workers have run their
  ``worker_init_fn`` (one worker start, as the loop sees it), median over epochs.
* **worker cpu**: the CPU time (user + system) a worker process had used when its
  ``worker_init_fn`` ran: interpreter start-up, ``sitecustomize``, unpickling the
  dataset (torch's import), median over workers. Unlike the wall times it hardly moves
  with the load of other work on a shared machine.
* **process**: the whole process from outside: interpreter and torch start-up, the
  parent's own SDK set-up and its exit flush included (the dead endpoint makes the
  exit wait up to ``OTEL_TRAINING_SHUTDOWN_TIMEOUT``), for context.

The ratio is the median of each round's instrumented/plain ratio (a round's runs are
adjacent in time, so they share the machine's load). One unmeasured run of each comes
first, and the processes run with bytecode caching on (``PYTHONDONTWRITEBYTECODE``
removed from their environment), as a user's Python does: without it every child
compiles the editable package's sources at each import.

    .venv/bin/python benchmarks/worker_startup.py [--rounds 5] [--epochs 4] [--methods spawn,forkserver]
    .venv/bin/python benchmarks/worker_startup.py --profile   # where a spawned worker's CPU goes

Target: loop instrumented / plain <= 1.10 for spawn and forkserver.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

WORKERS = 2
_STARTED = (0.0, 0.0)  # in a worker: when its worker_init_fn ran, and its CPU time then


def _mark_started(worker_id: int) -> None:
    global _STARTED
    _STARTED = (time.time(), time.process_time())


class Tiny(Dataset):
    """A few tensors per item; each item also says when its worker started, and the
    CPU time it had used by then."""

    def __init__(self, n: int, width: int) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.randn(self.width), i % 4, torch.tensor(_STARTED, dtype=torch.float64)


def workload(args) -> int:
    """The measured script: a tiny model, workers re-created every epoch. No
    OpenTelemetry in here."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = DataLoader(Tiny(args.batches * args.batch_size, 16), batch_size=args.batch_size,
                        num_workers=WORKERS, multiprocessing_context=args.workload,
                        persistent_workers=False, worker_init_fn=_mark_started)
    ups, cpus = [], []
    start = time.perf_counter()
    for _ in range(args.epochs):
        begin = time.time()
        stamps = set()
        for x, y, started in loader:
            stamps.update(map(tuple, started.tolist()))
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            _ = loss.item()
        ups.append(max(wall for wall, _ in stamps) - begin)
        cpus.extend(cpu for _, cpu in stamps)
    loop = time.perf_counter() - start
    print(f"LOOP_S {loop:.4f} WORKER_UP_S {statistics.median(ups):.4f} "
          f"WORKER_CPU_S {statistics.median(cpus):.4f}", flush=True)
    return 0


# -- where a spawned worker's start-up goes -------------------------------------------------

# Stands in for opentelemetry-instrument's sitecustomize (on PYTHONPATH instead of it): the
# same calls in the same order, each timed in CPU seconds; every process reports on stderr.
_PROFILE_SITECUSTOMIZE = r'''
import os, sys, time
_t = 0.0  # CPU time since the process started
def _report(what):
    global _t
    now = time.process_time()
    sys.stderr.write(f"PROFILE {os.getpid()} {'--multiprocessing-fork' in sys.orig_argv} {what} {now - _t:.4f}\n")
    _t = now
_report("interpreter start-up")
from opentelemetry.instrumentation.auto_instrumentation import _load
_report("import opentelemetry-instrument's auto_instrumentation")
distro = _load._load_distro()
_report("find and import the distro")
distro.configure()
_report("distro.configure()")
_load._load_configurators()
_report("configurator: SDK, exporters")
_load._load_instrumentors(distro)
_report("instrumentors")
'''


def profile(args, env) -> None:
    """One instrumented spawn run with the timed stand-in: CPU seconds per step of
    ``opentelemetry-instrument``'s start-up in each worker, medians over workers."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as site:
        with open(os.path.join(site, "sitecustomize.py"), "w") as fh:
            fh.write(_PROFILE_SITECUSTOMIZE)
        env = dict(env, PYTHONPATH=site)
        cmd = [sys.executable, os.path.abspath(__file__), "--workload", "spawn", "--epochs", str(args.epochs),
               "--batches", str(args.batches), "--batch-size", str(args.batch_size)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or "LOOP_S" not in proc.stdout:
        raise SystemExit(f"profile run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    steps: dict = {}
    for line in proc.stderr.splitlines():
        if line.startswith("PROFILE "):
            _, pid, child, rest = line.split(" ", 3)
            what, seconds = rest.rsplit(" ", 1)
            if child == "True":
                steps.setdefault(what, []).append(float(seconds))
    worker_cpu = float(proc.stdout.split("WORKER_CPU_S", 1)[1].split()[0])
    print(f"CPU seconds in a spawned DataLoader worker under the stand-in for opentelemetry-instrument, "
          f"median of {max(len(v) for v in steps.values())} workers")
    total = 0.0
    for what, values in steps.items():
        total += statistics.median(values)
        print(f"  {what:<56}{statistics.median(values):>8.3f}")
    print(f"  {'then: main script, dataset (torch), up to worker_init_fn':<56}{worker_cpu - total:>8.3f}")
    print(f"  {'worker CPU at worker_init_fn':<56}{worker_cpu:>8.3f}")


# -- the driver ---------------------------------------------------------------------------

def _one(kind: str, method: str, args, env) -> dict:
    import subprocess

    from tests.scripts.harness import BIN

    me = [sys.executable, os.path.abspath(__file__), "--workload", method, "--epochs", str(args.epochs),
          "--batches", str(args.batches), "--batch-size", str(args.batch_size)]
    cmd = me if kind == "plain" else [str(BIN / "opentelemetry-instrument"), *me]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or "LOOP_S" not in proc.stdout:
        raise SystemExit(f"{kind} {method} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    fields = proc.stdout.split("LOOP_S", 1)[1].split()
    return {"loop": float(fields[0]), "up": float(fields[2]), "cpu": float(fields[4]), "process": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", help=argparse.SUPPRESS)  # the measured script (a start method)
    p.add_argument("--rounds", type=int, default=5, help="plain/instrumented pairs per start method")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batches", type=int, default=4, help="batches per epoch")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--methods", default="spawn,forkserver")
    p.add_argument("--live", action="store_true", help="export to a real OTLP receiver on loopback")
    p.add_argument("--profile", action="store_true",
                   help="only show where an instrumented spawned worker's start-up CPU time goes")
    args = p.parse_args()
    if args.workload:
        sys.exit(workload(args))

    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.otlp_receiver import OTLPReceiver, free_port
    from tests.scripts.harness import otel_env

    methods = [m for m in args.methods.split(",") if m]
    receiver = OTLPReceiver().start() if args.live else None
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            endpoint = receiver.endpoint if receiver else f"http://127.0.0.1:{free_port()}"
            instr_env = otel_env(endpoint, Path(tmp), OTEL_SERVICE_NAME="worker-startup")
            instr_env.pop("PYTHONDONTWRITEBYTECODE", None)
            plain_env = {k: v for k, v in instr_env.items() if not k.startswith("OTEL_")}
            if args.profile:
                profile(args, instr_env)
                return
            for method in methods:
                for kind in ("plain", "instrumented"):  # warm-up: bytecode and file caches
                    _one(kind, method, args, plain_env if kind == "plain" else instr_env)
                rows = {"plain": [], "instrumented": []}
                for i in range(args.rounds):
                    order = ["plain", "instrumented"] if i % 2 == 0 else ["instrumented", "plain"]
                    for kind in order:
                        rows[kind].append(_one(kind, method, args, plain_env if kind == "plain" else instr_env))
                    print(f"  {method} round {i + 1}: " + ", ".join(
                        f"{k} loop {rows[k][-1]['loop']:.2f} s" for k in ("plain", "instrumented")),
                        file=sys.stderr, flush=True)
                results[method] = rows
    finally:
        if receiver is not None:
            receiver.stop()

    med = statistics.median
    print(f"{args.rounds} alternating rounds per start method; {WORKERS} workers re-created each of "
          f"{args.epochs} epochs ({args.batches} batches of {args.batch_size}); "
          f"{'live receiver' if args.live else 'closed loopback port'}; medians")
    print(f"  {'method':<11}{'figure':<12}{'plain':>9}{'instr':>9}{'ratio':>8}   (per-round ratios)")
    for method, rows in results.items():
        for key, label in (("loop", "loop s"), ("up", "worker up"), ("cpu", "worker cpu"),
                           ("process", "process s")):
            plain, instr = [r[key] for r in rows["plain"]], [r[key] for r in rows["instrumented"]]
            ratios = sorted(a / b for a, b in zip(instr, plain))
            note = " ".join(f"{r:.2f}" for r in ratios)
            print(f"  {method:<11}{label:<12}{med(plain):>9.3f}{med(instr):>9.3f}{med(ratios):>8.2f}   ({note})")
    for method, rows in results.items():
        ratio = med([a["loop"] / b["loop"] for a, b in zip(rows["instrumented"], rows["plain"])])
        print(f"loop ratio, {method}: {ratio:.2f}  (target <= 1.10)")


if __name__ == "__main__":
    main()
