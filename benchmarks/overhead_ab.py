"""Two checkouts' overhead side by side, in lock-step: a before/after figure for a
change to the per-step path that a noisy machine cannot blur.

One worker process per checkout (its package first on ``sys.path``). The driver asks
them for one ``overhead.py`` round at a time (a plain epoch, an instrumented one, a
plain one, on the ~1 ms case), alternating which goes first, so the machine's drift
over minutes falls on both alike. Both workers are replaced by fresh ones every
``--restart-every`` rounds: one process can run 10-20 µs a step slower than another
for the whole of its life (where its memory and core landed), as an A/A run with
two long-lived workers shows. Printed: each checkout's median ratio and µs added per
step, and the median of the paired per-round differences. Run a checkout against
itself (A/A) to see the noise floor.

    .venv/bin/python benchmarks/overhead_ab.py BEFORE AFTER [--rounds 20] [--restart-every 4]

e.g. ``git worktree add /tmp/before HEAD~1`` then
``.venv/bin/python benchmarks/overhead_ab.py /tmp/before .``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

# The worker: overhead.py's ~1 ms workload and round, one round per line on stdin.
_WORKER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[2])
import torch
from overhead import _run_epoch, _workload, instrumented_round
import otel_training
torch.set_num_threads(1)
work = _workload(256, 3, 64, 1200)
_run_epoch(*work)
print(json.dumps({"package": otel_training.__file__}), flush=True)
for _ in sys.stdin:
    before = _run_epoch(*work)
    instr, after = instrumented_round(work)
    plain = (before + after) / 2
    print(json.dumps({"ratio": instr / plain, "added_us": (instr - plain) * 1e6}), flush=True)
"""


def _start(checkout: str) -> subprocess.Popen:
    root = os.path.abspath(checkout)
    # Run from outside any checkout: the current directory would come first on sys.path.
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, root, _HERE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(root) or "/",
    )


def _stop(workers: list[subprocess.Popen]) -> None:
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.close()
        worker.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="a checkout (the directory holding otel_training/)")
    parser.add_argument("after", help="another checkout, or the same one for an A/A run")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--restart-every", type=int, default=4, help="rounds per pair of worker processes")
    args = parser.parse_args()
    names = (args.before, args.after)
    results: list[list[dict]] = [[], []]
    workers: list[subprocess.Popen] = []
    for i in range(args.rounds):
        if i % max(1, args.restart_every) == 0:
            _stop(workers)
            workers = [_start(name) for name in names]
            for name, worker in zip(names, workers):
                line = worker.stdout.readline() if worker.stdout else ""
                if not line:
                    sys.exit(f"the worker for {name} did not start")
                if i == 0:
                    print(f"{name}: {json.loads(line)['package']}")
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            worker = workers[k]
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write("round\n")
            worker.stdin.flush()
            results[k].append(json.loads(worker.stdout.readline()))
    _stop(workers)
    med = statistics.median
    for name, rows in zip(names, results):
        ratios = [r["ratio"] for r in rows]
        q = statistics.quantiles(ratios, n=4)
        added = med(r["added_us"] for r in rows)
        print(f"{name:<24} ratio {med(ratios):.3f} ({q[0]:.3f}-{q[2]:.3f})   added {added:6.1f} µs/step")
    diffs = [b["added_us"] - a["added_us"] for a, b in zip(*results)]
    q = statistics.quantiles(diffs, n=4)
    print(f"after - before, paired by round: {med(diffs):+.1f} µs/step (quartiles {q[0]:+.1f} to {q[2]:+.1f})")


if __name__ == "__main__":
    main()
