"""The garbage collector's share of a ~1 ms step, in a long run: what 1 200-step
epochs cannot show.

Steps waiting in the pipeline's queue keep their tracked objects (the step, its
lists, its phase records) alive; whatever is alive when a young-generation collection
runs is promoted, and CPython runs a full collection once the objects promoted since
the last one exceed a quarter of the long-lived ones. A plain loop promotes nothing, so
it never pays a full collection; ours does, every so many thousand steps, and a full
collection walks every object of the process (torch, the SDK, the user's).

For the ``overhead.py`` ~1 ms loop, instrumented with the default configuration, this
prints per step: the objects promoted to the old generation, the young collections'
time, and the full collections' time amortized -- one full collection timed here
(``gc.collect()``) over the steps it takes to trigger one. The plain loop is measured
alike.

    .venv/bin/python benchmarks/gc_pressure.py [--epochs 5]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from overhead import _providers, _run_epoch, _workload

STEPS = 1200


class _Collections:
    """Collections by generation (count, ns) and objects promoted to the old generation."""

    def __init__(self) -> None:
        self.on = False
        self.count = [0, 0, 0]
        self.ns = [0, 0, 0]
        self.promoted = 0
        self._start = 0
        self._old = 0

    def reset(self) -> None:
        self.count, self.ns, self.promoted = [0, 0, 0], [0, 0, 0], 0

    def __call__(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        generation = info["generation"]
        if phase == "start":
            if generation == 1:  # (counting the old generation is not timed)
                self._old = len(gc.get_objects(generation=2))
            self._start = time.perf_counter_ns()
        else:
            self.ns[generation] += time.perf_counter_ns() - self._start
            self.count[generation] += 1
            if generation == 1:
                self.promoted += len(gc.get_objects(generation=2)) - self._old


def _epochs(work, epochs: int, record: _Collections, finish=None) -> None:
    record.reset()
    record.on = True
    for _ in range(epochs):
        _run_epoch(*work, finish=finish)
    record.on = False


def _print(name: str, record: _Collections, steps: int, full_ns: int, long_lived: int) -> None:
    promoted = record.promoted / steps
    young = (record.ns[0] + record.ns[1]) / steps / 1e3
    # CPython's trigger: promoted since the last full collection > long-lived / 4.
    period = long_lived / 4 / promoted if promoted else float("inf")
    amortized = full_ns / period / 1e3 if promoted else 0.0
    print(f"{name:13} {promoted:10.2f} {record.count[0]:7d} {record.count[1]:7d} {young:9.2f}"
          f" {period:13.0f} {amortized:11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help=f"epochs of {STEPS} steps per set-up")
    args = parser.parse_args()
    from otel_training import runtime
    from otel_training.instrumentor import TrainingInstrumentor

    torch.set_num_threads(1)
    work = _workload(256, 3, 64, STEPS)
    _run_epoch(*work)  # warm up
    record = _Collections()
    gc.callbacks.append(record)
    steps = args.epochs * STEPS

    t0 = time.perf_counter_ns()
    gc.collect()
    full_ns = time.perf_counter_ns() - t0
    long_lived = len(gc.get_objects(generation=2))
    _epochs(work, args.epochs, record)
    plain = (list(record.count), list(record.ns), record.promoted)

    tp, mp = _providers()
    inst = TrainingInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=mp)
    try:
        _run_epoch(*work, limit=20)
        pipeline = runtime.current().pipeline
        pipeline.flush(10.0)
        instrumented = _Collections()
        gc.callbacks.append(instrumented)
        _epochs(work, args.epochs, instrumented, finish=lambda: pipeline.flush(10.0))
        gc.callbacks.remove(instrumented)
    finally:
        inst.uninstrument()
        tp.shutdown()
        mp.shutdown()
    gc.callbacks.remove(record)

    print(f"{steps} steps a set-up; a full collection here: {full_ns / 1e6:.0f} ms over {long_lived} objects")
    print(f"{'set-up':13} {'promoted/step':>10} {'gen0':>7} {'gen1':>7} {'young µs/step':>9}"
          f" {'steps per full':>13} {'full µs/step':>11}")
    record.count, record.ns, record.promoted = plain
    _print("plain", record, steps, full_ns, long_lived)
    _print("instrumented", instrumented, steps, full_ns, long_lived)


if __name__ == "__main__":
    main()
