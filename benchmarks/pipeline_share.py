"""The pipeline's share of a ~1 ms step, in two clocks a noisy machine cannot blur.

For the ``overhead.py`` ~1 ms loop, each epoch is timed three ways: the pipeline
thread's CPU per step, the training thread's CPU per step, and the training thread's
*blocked* time per step (its wall time less its own CPU time: waiting for the GIL;
a plain loop has none). Set-ups, toggled in one process, round after round:

- ``plain``: no instrumentation;
- ``poll=S``: the default pipeline, draining every ``S`` seconds (``--polls``);
- ``empty``: the pipeline only empties its queue (what waking and freeing cost).

Every µs of pipeline CPU costs the training thread about one µs of waiting, so the
two columns move together on two cores (docs/performance.md, "Where the cost is").

    .venv/bin/python benchmarks/pipeline_share.py [--rounds 6] [--polls 0.1,0.5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from overhead import _providers, _run_epoch, _workload

STEPS = 1200


def _instrumented(work, setup: str) -> tuple[float, float, float]:
    from otel_training import runtime
    from otel_training.aggregate import pipeline as pipeline_mod
    from otel_training.instrumentor import TrainingInstrumentor

    drain = pipeline_mod.Pipeline._drain_steps
    poll = pipeline_mod._POLL_S
    if setup == "empty":
        pipeline_mod.Pipeline._drain_steps = lambda self, queue, deadline: queue.clear()
    else:
        pipeline_mod._POLL_S = float(setup.split("=")[1])
    tp, mp = _providers()
    inst = TrainingInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=mp)
    try:
        _run_epoch(*work, limit=20)  # root discovery: set-up
        pipeline = runtime.current().pipeline
        pipeline.flush(10.0)
        clock = time.pthread_getcpuclockid(pipeline._thread.ident)
        p0, t0, w0 = time.clock_gettime_ns(clock), time.thread_time_ns(), time.perf_counter_ns()
        _run_epoch(*work, finish=lambda: pipeline.flush(10.0))
        p1, t1, w1 = time.clock_gettime_ns(clock), time.thread_time_ns(), time.perf_counter_ns()
    finally:
        inst.uninstrument()
        tp.shutdown()
        mp.shutdown()
        pipeline_mod.Pipeline._drain_steps = drain
        pipeline_mod._POLL_S = poll
    n = STEPS * 1e3
    return (p1 - p0) / n, (t1 - t0) / n, ((w1 - w0) - (t1 - t0)) / n


def _plain(work) -> tuple[float, float, float]:
    t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    _run_epoch(*work)
    t1, w1 = time.thread_time_ns(), time.perf_counter_ns()
    n = STEPS * 1e3
    return 0.0, (t1 - t0) / n, ((w1 - w0) - (t1 - t0)) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--polls", default="0.1,0.5", help="drain intervals to compare, in seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = _workload(256, 3, 64, STEPS)
    _run_epoch(*work)  # warm up
    setups = ["plain", *(f"poll={p}" for p in args.polls.split(",")), "empty"]
    results: dict[str, list] = {s: [] for s in setups}
    for r in range(args.rounds):
        for setup in setups[r % len(setups):] + setups[: r % len(setups)]:
            results[setup].append(_plain(work) if setup == "plain" else _instrumented(work, setup))
    print(f"{'set-up':10} {'pipeline CPU':>13} {'training CPU':>13} {'blocked':>9}   (µs a step, medians)")
    for setup, rows in results.items():
        pipe, train, blocked = (statistics.median(col) for col in zip(*rows))
        print(f"{setup:10} {pipe:13.1f} {train:13.1f} {blocked:9.1f}")


if __name__ == "__main__":
    main()
