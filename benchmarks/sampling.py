"""CPU cost of one hardware collection: otel-training vs opentelemetry-instrumentation-system-metrics.

Run:  .venv/bin/python benchmarks/sampling.py [--collections N] [--rounds R]

Both sides run on this thread, interleaved in rounds, each with its own MeterProvider
and InMemoryMetricReader; the cost is ``time.thread_time()`` per collection (CPU, not
wall time). Ours counts one sampler tick (the /proc or psutil reads) plus the reader's
collect() (the gauge callbacks), i.e. the work per export when the sampling
interval equals the export interval; the system-metrics instrumentation reads
psutil inside its callbacks, so its cost is collect() alone. Per GPU (on a machine
where NVML initialises): CPU and wall time of one tick's NVML reads.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from otel_training.config import Config  # noqa: E402
from otel_training.hardware import start_hardware_metrics  # noqa: E402

# The instrumentation's own default states for the metrics comparable to our host set.
SYSTEM_METRICS_CONFIG = {
    "system.cpu.utilization": ["idle", "user", "system", "irq"],
    "system.memory.usage": ["used", "free", "cached"],
    "system.network.io": ["transmit", "receive"],
    "system.disk.io": ["read", "write"],
    "system.disk.operations": ["read", "write"],
}

TARGET_MS = 2.0
TARGET_RATIO = 5.0


def _ms_per(fn, n: int) -> float:
    start = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - start) * 1000.0 / n


def _count_points(reader) -> int:
    data = reader.get_metrics_data()
    return sum(len(m.data.data_points) for rm in data.resource_metrics
               for sm in rm.scope_metrics for m in sm.metrics)


def host(collections: int, rounds: int) -> None:
    from opentelemetry.instrumentation.system_metrics import SystemMetricsInstrumentor

    lock = os.path.join(tempfile.mkdtemp(), "bench.lock")
    ours_reader = InMemoryMetricReader()
    ours_provider = MeterProvider(metric_readers=[ours_reader])
    ours = start_hardware_metrics(ours_provider, Config(), host_name="bench", lock_path=lock,
                                  start=False, gpu=False)
    theirs_reader = InMemoryMetricReader()
    theirs_provider = MeterProvider(metric_readers=[theirs_reader])
    SystemMetricsInstrumentor(config=SYSTEM_METRICS_CONFIG).instrument(
        meter_provider=theirs_provider)

    def ours_collection():
        ours.collect_once()
        ours_reader.collect()

    for _ in range(20):  # warm up: baselines, first-call caches
        ours_collection()
        theirs_reader.collect()
    ours_ms, tick_ms, export_ms, theirs_ms = [], [], [], []
    for _ in range(rounds):
        ours_ms.append(_ms_per(ours_collection, collections))
        theirs_ms.append(_ms_per(theirs_reader.collect, collections))
        tick_ms.append(_ms_per(ours.collect_once, collections))
        export_ms.append(_ms_per(ours_reader.collect, collections))
    o, t = statistics.median(ours_ms), statistics.median(theirs_ms)
    print(f"host: {os.cpu_count()} CPUs, {platform.python_implementation()} "
          f"{platform.python_version()}, {collections} collections x {rounds} rounds, "
          "median of rounds, CPU ms per collection")
    print(f"  otel-training host set        {o:7.3f} ms  ({_count_points(ours_reader)} points;"
          f" sampler tick {statistics.median(tick_ms):.3f} + collect "
          f"{statistics.median(export_ms):.3f})")
    print(f"  system-metrics instrumentation {t:6.3f} ms  ({_count_points(theirs_reader)} points)")
    tick, export = statistics.median(tick_ms), statistics.median(export_ms)
    print(f"  ratio                          {t / o:6.1f}x cheaper "
          f"(targets: <= {TARGET_MS:g} ms, >= {TARGET_RATIO:g}x: "
          f"{'met' if o <= TARGET_MS and t / o >= TARGET_RATIO else 'NOT met'})")
    print(f"  export path only (collect)     {t / export:6.1f}x cheaper "
          f"({export:.3f} ms: the sampler's host reads run on its own thread)")
    # defaults: sampling every 1 s, exporting every 5 s (the otel-training distro)
    print(f"  per 5 s export at 1 s sampling {5 * tick + export:6.3f} ms "
          f"(vs {t:.3f} ms: five ticks buy the interval average)")
    ours.shutdown()
    SystemMetricsInstrumentor().uninstrument()
    ours_provider.shutdown()
    theirs_provider.shutdown()


def gpu(collections: int) -> None:
    try:
        import pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:
        print(f"gpu: skipped (no NVML on this machine: {type(exc).__name__}: {exc})")
        return
    if not count:
        print("gpu: skipped (NVML found no GPU)")
        return
    from otel_training.hardware.gpu import GpuSource
    from otel_training.hardware.stats import Store

    source = GpuSource(Store(), "bench")
    source.start()
    source.sample_devices()
    source.sample_process()
    n = max(1, collections // 10)  # PCIe reads block 2 x 20 ms per GPU
    wall = time.perf_counter()
    cpu = _ms_per(lambda: (source.sample_devices(), source.sample_process()), n)
    wall = (time.perf_counter() - wall) * 1000.0 / n
    name = source.gpus[0].gpu["hw.model"] if source.gpus else "?"
    print(f"gpu: {count} x {name}, {n} ticks")
    print(f"  per GPU per tick: {cpu / count:.3f} ms CPU, {wall / count:.1f} ms wall "
          "(the wall time is NVML's 20 ms PCIe windows, on the sampler thread)")
    source.close()
    pynvml.nvmlShutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collections", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    host(args.collections, args.rounds)
    gpu(args.collections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
