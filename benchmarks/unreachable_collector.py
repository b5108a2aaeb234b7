"""Training with no Collector: wall time and exit latency, plain vs instrumented.

Two measurements, each side by side with an uninstrumented run:

1. **Wall time**, in one process (as benchmarks/overhead.py): epochs of a CPU training
   loop alternate between plain and instrumented with the real SDK -- batch span
   processor and periodic metric reader with OTLP/gRPC exporters -- pointed at a closed
   port on loopback, so every export fails and retries with backoff for the whole run
   (``--live`` adds a third configuration exporting to a real OTLP receiver). The
   ratio is the median over rounds of each round's instrumented/plain per-step time
   (the order within a round rotates).
2. **Exit latency**, with real processes: ``python tests/scripts/train_loop.py`` vs
   ``opentelemetry-instrument python tests/scripts/train_loop.py`` with the Collector
   unreachable; from the script's ``TRAINING_END`` line to the process exit.

    .venv/bin/python benchmarks/unreachable_collector.py [--rounds 20] [--exit-rounds 3] [--live]

Targets: instrumented-with-dead-collector / plain wall time <= 1.02; exit
latency <= 3 s (OTEL_TRAINING_SHUTDOWN_TIMEOUT defaults to 2 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from otel_training.distro import METRIC_EXPORT_INTERVAL_MS  # noqa: E402
from tests.otlp_receiver import OTLPReceiver, free_port  # noqa: E402
from tests.scripts.harness import instrumented, otel_env, plain, run  # noqa: E402


def _providers(endpoint: str):
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    # The distro's export interval (5 s), as shipped.
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, insecure=True),
                                           float(METRIC_EXPORT_INTERVAL_MS))
    return tp, MeterProvider(metric_readers=[reader])


def _workload(width: int, batch: int, steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 4))
    data = TensorDataset(torch.randn(batch * steps, width), torch.randint(0, 4, (batch * steps,)))
    return model, DataLoader(data, batch_size=batch), torch.optim.SGD(model.parameters(), lr=0.01)


WARMUP_STEPS = 3  # per epoch: a fresh instrumentation's start-up (hook discovery, first
# hardware sample, threads starting) is paid once per run, not per step


def _epoch(model, loader, opt) -> float:
    loss_fn = nn.CrossEntropyLoss()
    start = None
    n = 0
    for i, (x, y) in enumerate(loader):
        if i == WARMUP_STEPS:
            start = time.perf_counter()
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        n += i >= WARMUP_STEPS
    return (time.perf_counter() - start) / n


def wall_time(args) -> dict:
    from otel_training.config import load_config
    from otel_training.instrumentor import TrainingInstrumentor

    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)  # the exporters' retry warnings
    config = dataclasses.replace(load_config({}), trace_every_n=args.trace_every_n, summary=False,
                                 hardware=not args.no_hardware, shutdown_timeout=0.5)
    providers = {"dead": _providers(f"http://127.0.0.1:{free_port()}")}
    receiver = None
    if args.live:
        receiver = OTLPReceiver().start()
        providers["live"] = _providers(receiver.endpoint)
    work = _workload(args.width, args.batch_size, args.steps)
    _epoch(*work)  # warm up
    kinds = ["plain", *providers]
    times = {k: [] for k in kinds}
    try:
        for i in range(args.rounds):
            order = kinds[i % len(kinds):] + kinds[:i % len(kinds)]  # rotate: no kind always first
            for kind in order:
                if kind == "plain":
                    times[kind].append(_epoch(*work))
                    continue
                tp, mp = providers[kind]
                inst = TrainingInstrumentor()
                inst.instrument(tracer_provider=tp, meter_provider=mp, config=config)
                times[kind].append(_epoch(*work))
                inst.uninstrument()
    finally:
        for tp, mp in providers.values():
            tp.shutdown()
            mp.shutdown(timeout_millis=500)
        if receiver is not None:
            receiver.stop()
    out = {}
    for kind in kinds:
        # Each round's runs are adjacent in time, so they share the machine's background
        # load: the median of per-round ratios is steadier than a ratio of medians.
        ratios = sorted(t / p for t, p in zip(times[kind], times["plain"]))
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        out[kind] = {"step_ms": statistics.median(times[kind]) * 1e3, "ratio": statistics.median(ratios),
                     "ratio_q1": q[0], "ratio_q3": q[2]}
    return out


def exit_latency(args) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        receiver = OTLPReceiver().start() if args.live else None
        try:
            dead = f"http://127.0.0.1:{free_port()}"
            kinds = ["plain", "dead"] + (["live"] if args.live else [])
            rows = {k: [] for k in kinds}
            for _ in range(args.exit_rounds):
                for kind in kinds:
                    endpoint = receiver.endpoint if kind == "live" else dead
                    env = otel_env(endpoint, Path(tmp), OTEL_TRAINING_TRACE_EVERY_N="1")
                    script = ("train_loop.py", "--steps", "100")
                    r = run(plain(*script) if kind == "plain" else instrumented(*script), env, timeout=300)
                    if r.proc.returncode != 0:
                        raise SystemExit(f"{kind} run failed:\n{r.stderr}")
                    rows[kind].append(r.exit_latency())
            for kind, values in rows.items():
                out[kind] = {"exit_s": statistics.median(values), "exit_max_s": max(values)}
        finally:
            if receiver is not None:
                receiver.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="interleaved epochs per configuration")
    p.add_argument("--steps", type=int, default=100, help="steps per epoch")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--trace-every-n", type=int, default=100, help="OTEL_TRAINING_TRACE_EVERY_N (default 100, as shipped; 1 exports the most)")
    p.add_argument("--exit-rounds", type=int, default=3)
    p.add_argument("--live", action="store_true", help="also measure with a live OTLP receiver")
    p.add_argument("--no-hardware", action="store_true", help="hardware sampler off (on by default)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads for the wall-time runs (0: torch's default, all cores)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    wall = wall_time(args)
    exits = exit_latency(args) if args.exit_rounds > 0 else {}
    if args.json:
        print(json.dumps({"config": vars(args), "wall": wall, "exit": exits}, indent=1))
        return
    print(f"wall time: {args.rounds} interleaved rounds of {args.steps} steps (width {args.width}, "
          f"batch {args.batch_size}, OTEL_TRAINING_TRACE_EVERY_N={args.trace_every_n}, "
          f"{torch.get_num_threads()} torch threads), medians")
    print(f"  {'run':<8}{'step ms':>10}{'ratio':>8}   (interquartile range of the per-round ratios)")
    for kind, s in wall.items():
        print(f"  {kind:<8}{s['step_ms']:>10.3f}{s['ratio']:>8.3f}   ({s['ratio_q1']:.3f} .. {s['ratio_q3']:.3f})")
    if exits:
        print(f"exit latency after training ends: {args.exit_rounds} runs each, median (max)")
        for kind, s in exits.items():
            print(f"  {kind:<8}{s['exit_s']:>7.2f} s ({s['exit_max_s']:.2f} s)")


if __name__ == "__main__":
    main()
