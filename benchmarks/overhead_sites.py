"""Where the added time lands: per call site of a ~1 ms CPU training step.

A diagnostic beside ``overhead.py``: it times each call of the loop (the
DataLoader's ``next``, the model, the loss module, ``zero_grad``, ``backward``,
``opt.step``) plain and instrumented, in rounds in one process, and prints the
median µs added at each site, for three set-ups:

- ``bail``: hooks installed but the tracker ignores the thread (what the wrappers
  alone cost);
- ``hooks``: hooks and tracker, the pipeline receiving nothing (the training
  thread's own work);
- ``full``: the default configuration (the pipeline's work and its GIL hand-overs
  land wherever the training thread was waiting for the GIL).

With ``--clock cpu`` each site is timed in the training thread's CPU time rather than
wall time: the pipeline's share (time spent waiting for the GIL) drops out, and so does
most of this VM's drift, which makes the training thread's own cost steadier to compare.

    .venv/bin/python benchmarks/overhead_sites.py [--rounds 7] [--clock cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from overhead import _providers, _run_epoch, _workload

SITES = ("next", "model", "loss", "zero_grad", "backward", "opt.step")
SETUPS = ("bail", "hooks", "full")


CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def _epoch(model, loader, opt, loss_fn, clock=time.perf_counter_ns) -> list:
    """Mean µs per step spent in each site."""
    acc = [0] * len(SITES)
    n = 0
    it = iter(loader)
    while True:
        t0 = clock()
        try:
            x, y = next(it)
        except StopIteration:
            break
        t1 = clock()
        out = model(x)
        t2 = clock()
        loss = loss_fn(out, y)
        t3 = clock()
        opt.zero_grad(set_to_none=True)
        t4 = clock()
        loss.backward()
        t5 = clock()
        opt.step()
        t6 = clock()
        for i, d in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            acc[i] += d
        n += 1
    return [a / n / 1e3 for a in acc]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time (default) or the training thread's CPU time")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    from otel_training.aggregate import pipeline as pipeline_mod
    from otel_training import runtime
    from otel_training.instrumentor import TrainingInstrumentor

    torch.set_num_threads(1)
    work = _workload(256, 3, 64, 1000)
    _epoch(*work)  # warm up
    submit = pipeline_mod.Pipeline.submit
    results = {k: [] for k in ("plain",) + SETUPS}
    for _ in range(args.rounds):
        results["plain"].append(_epoch(*work, clock=clock))
        for setup in SETUPS:
            pipeline_mod.Pipeline.submit = submit if setup == "full" else (lambda self, step: None)
            tp, mp = _providers()
            inst = TrainingInstrumentor()
            inst.instrument(tracer_provider=tp, meter_provider=mp)
            try:
                _run_epoch(*work, limit=20)  # root discovery: set-up, not per-step cost
                if setup == "bail":
                    runtime.current().tracker.thread = -1  # no thread is the training thread
                results[setup].append(_epoch(*work, clock=clock))
            finally:
                inst.uninstrument()
                pipeline_mod.Pipeline.submit = submit
                tp.shutdown()
                mp.shutdown()
        results["plain"].append(_epoch(*work, clock=clock))
    med = {k: [statistics.median(col) for col in zip(*v)] for k, v in results.items()}
    print(f"{'site':<11}{'plain us':>10}" + "".join(f"{'+' + s:>10}" for s in SETUPS))
    for i, site in enumerate(SITES):
        print(f"{site:<11}{med['plain'][i]:>10.1f}" + "".join(f"{med[s][i] - med['plain'][i]:>10.1f}" for s in SETUPS))
    total = sum(med["plain"])
    print(f"{'step':<11}{total:>10.1f}" + "".join(f"{sum(med[s]) - total:>10.1f}" for s in SETUPS))


if __name__ == "__main__":
    main()
