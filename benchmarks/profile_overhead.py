"""What profiles cost (docs/profiles.md, docs/performance.md#profiles), in one process:

1. **Armed, not firing**: ``overhead.py``'s ~1 ms case instrumented with
   ``OTEL_TRAINING_PROFILE=off`` and with ``auto`` (every trigger armed; the loop never
   fires one), in alternating rounds, each against the plain epochs around it. Printed:
   each setting's median µs added per step and the median paired difference (auto - off).
2. **A recorded step**: with ``auto``, profiles of ``--steps`` steps asked for mid-epoch
   (as ``otel-training profile`` does), the first in the process and later ones; each
   step timed by the loop's own clock. Printed: the median ordinary step, the recorded
   steps (the first pays torch.profiler's start), and the steps after while the results
   are read on a worker thread.

    .venv/bin/python benchmarks/profile_overhead.py [--rounds 10] [--steps 2] [--profiles 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # (as the distro sets it: no line per profile)
import torch  # noqa: E402
from overhead import _providers, _run_epoch, _workload, instrumented_round  # noqa: E402

from otel_training import runtime  # noqa: E402
from otel_training.config import load_config  # noqa: E402
from otel_training.instrumentor import TrainingInstrumentor  # noqa: E402
from otel_training.record.profile_capture import Request  # noqa: E402


def armed(rounds: int) -> dict:
    work = _workload(256, 3, 64, 1200)
    _run_epoch(*work)
    added: dict[str, list[float]] = {"off": [], "auto": []}
    pairs = []
    auto = load_config({}).profile
    for i in range(rounds):
        order = [("off", ()), ("auto", auto)]
        if i % 2:
            order.reverse()
        got = {}
        for name, profile in order:
            before = _run_epoch(*work)
            instr, after = instrumented_round(
                work, dataclasses.replace(load_config({}), profile=profile, hardware=False)
            )
            got[name] = (instr - (before + after) / 2) * 1e6
            added[name].append(got[name])
        pairs.append(got["auto"] - got["off"])
    return {
        "added_us_off": round(statistics.median(added["off"]), 2),
        "added_us_auto": round(statistics.median(added["auto"]), 2),
        "paired_auto_minus_off_us": round(statistics.median(pairs), 2),
        "paired_quartiles_us": [round(q, 2) for q in statistics.quantiles(pairs, n=4)] if len(pairs) > 1 else None,
        "rounds": rounds,
    }


def recorded(steps: int, profiles: int) -> dict:
    """Per-step seconds by the loop's own clock around profiles asked for mid-run."""
    model, loader, opt, loss_fn = _workload(256, 3, 64, 3000)
    config = dataclasses.replace(load_config({}), hardware=False, profile_steps=steps)
    tp, mp = _providers()
    inst = TrainingInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=mp, config=config)
    profiling = runtime.current().profiling
    times: list[float] = []
    asks = {400 + 600 * k for k in range(profiles)}
    start = time.perf_counter()
    for i, (x, y) in enumerate(loader):
        if i in asks:
            profiling.capture.request(Request("demand", 0, steps, {"step": None}))
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        now = time.perf_counter()
        times.append(now - start)
        start = now
    runtime.current().pipeline.flush(10.0)
    profiling.join(30.0)
    section = profiling.section()
    inst.uninstrument()
    tp.shutdown()
    mp.shutdown()
    ordinary = statistics.median(times[100:])
    out: dict = {"ordinary_step_ms": round(ordinary * 1e3, 3), "profiles": []}
    for p in section.profiles:
        numbers = [s.step for s in p.steps]
        if not numbers:
            continue
        first, last = numbers[0], numbers[-1]
        # The step whose start hands on the step before the first recorded one runs the
        # profiler's start; the loop's own clock sees it on the first recorded step.
        rec = times[first : last + 1]
        after = times[last + 1 : last + 21]
        out["profiles"].append(
            {
                "steps": numbers,
                "recorded_ms": [round(t * 1e3, 3) for t in rec],
                "recorded_x": round(statistics.mean(rec) / ordinary, 2),
                "next_20_added_ms": round((sum(after) - len(after) * ordinary) * 1e3, 2),
                "events": p.events,
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--profiles", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(json.dumps({"torch": torch.__version__, "armed_not_firing": armed(args.rounds)}))
    print(json.dumps({"recorded_steps": recorded(args.steps, args.profiles)}))


if __name__ == "__main__":
    main()
