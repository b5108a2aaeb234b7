"""A synthetic OTLP producer: the real OpenTelemetry SDK and OTLP/gRPC exporter, emitting
the contract's names and attributes (docs/telemetry.md) for two-rank "runs" (two at
once on one host, for the concurrent-runs tests).

It fills in only what the real instrumented run (``real_run.py``, the primary source)
cannot produce on a CPU machine or when healthy: GPU idle time (needs CUDA device
timing), the self-telemetry failure counters, tokens (the real example trains on
float features, not token ids) and the CUDA allocator's memory per step.
"""

from __future__ import annotations

import random
import time
import uuid

from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
           0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
PHASES = {"dataloader_next": 0.30, "to_device": 0.05, "train_batch": 0.55, "untracked": 0.10}
BATCH_CHILDREN = {"forward": 0.35, "backward": 0.5, "optimizer_step": 0.15}
HOST = "synthetic-host"  # its own host, run and job: never mixed with the real run
SERVICE = "synthetic-train"


class _Rank:
    def __init__(self, endpoint: str, run_id: str, rank: int, world: int, interval_ms: int,
                 idle: float = 0.25):
        resource = Resource.create({
            "service.name": SERVICE, "service.instance.id": str(uuid.uuid4()),
            "host.name": HOST, "training.run.id": run_id,
        })
        exporter = OTLPMetricExporter(endpoint=endpoint, insecure=True)
        self.reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms)
        views = [View(instrument_name="training.*.duration",
                      aggregation=ExplicitBucketHistogramAggregation(BUCKETS))]
        self.meters = MeterProvider(resource=resource, metric_readers=[self.reader], views=views)
        self.tracers = TracerProvider(resource=resource)
        self.tracers.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
        self.tracer = self.tracers.get_tracer("otel_training")
        meter = self.meters.get_meter("otel_training")
        self.common = {"host.name": HOST, "training.mode": "train", "training.rank": rank,
                       "training.local_rank": rank, "training.world_size": world}
        self.step = meter.create_histogram("training.step.duration", unit="s")
        self.phase = meter.create_histogram("training.phase.duration", unit="s")
        self.steps = meter.create_counter("training.steps", unit="{step}")
        self.samples = meter.create_counter("training.samples", unit="{sample}")
        self.idle = meter.create_counter("training.gpu.idle", unit="s")
        self.slow = 1.6 if rank == world - 1 else 1.0  # the last rank straggles
        self.rank = rank
        self.idle_share = idle  # GPU idle share while waiting for data: differs per run
        # Self-telemetry counters count only failures: a healthy run never emits them.
        self.dropped_spans = meter.create_counter("training.telemetry.spans.dropped", unit="{span}")
        self.dropped_steps = meter.create_counter("training.telemetry.steps.dropped", unit="{step}")
        self.export_failures = meter.create_counter("training.telemetry.export.failures",
                                                    unit="{failure}")
        self.errors = meter.create_counter("training.telemetry.errors", unit="{error}")
        self.tokens = meter.create_counter("training.tokens", unit="{token}")
        # Memory per step of a CUDA process: no training.mode, the GPU's hw.id.
        self.memory_attrs = {**{k: v for k, v in self.common.items() if k != "training.mode"},
                             "hw.id": f"GPU-synthetic-{run_id[-8:]}-{rank}"}
        self.allocated = meter.create_gauge("training.memory.allocated", unit="By")
        self.peak_allocated = meter.create_gauge("training.memory.peak_allocated", unit="By")
        self.peak_reserved = meter.create_gauge("training.memory.peak_reserved", unit="By")
        self.retries = meter.create_counter("training.memory.alloc_retries", unit="{retry}")
        self.ooms = meter.create_counter("training.memory.ooms", unit="{error}")

    def run_step(self, index: int, rng: random.Random) -> None:
        total = rng.uniform(0.08, 0.12) * self.slow
        with self.tracer.start_as_current_span("step") if index % 10 == 0 else _null():
            self.step.record(total, self.common)
            for name, share in PHASES.items():
                self.phase.record(total * share, {**self.common, "training.phase": name,
                                                  "training.phase.parent": "step"})
            for name, share in BATCH_CHILDREN.items():
                self.phase.record(total * PHASES["train_batch"] * share,
                                  {**self.common, "training.phase": name,
                                   "training.phase.parent": "train_batch"})
        self.steps.add(1, self.common)
        self.samples.add(32, self.common)
        self.tokens.add(32 * 128, self.common)
        # the straggler also keeps 1 MB a step: its memory creeps
        allocated = 6e9 + (index * 1e6 if self.slow > 1 else rng.uniform(0, 1e6))
        self.allocated.set(allocated, self.memory_attrs)
        self.peak_allocated.set(allocated + 2e9, self.memory_attrs)
        self.peak_reserved.set(allocated + 3e9, self.memory_attrs)
        self.idle.add(total * self.idle_share, {**self.common, "training.phase": "dataloader_next"})
        self.idle.add(total * 0.05, {**self.common, "training.phase": "to_device"})
        if index % 20 == 0:
            self.dropped_spans.add(1, self.common)
            self.dropped_steps.add(1, self.common)
            self.export_failures.add(1, {**self.common, "training.telemetry.component": "traces"})
            self.errors.add(1, {**self.common, "training.telemetry.component": "pipeline"})
            self.retries.add(1, self.memory_attrs)
            self.ooms.add(1, self.memory_attrs)

    def shutdown(self) -> None:
        self.meters.shutdown()
        self.tracers.shutdown()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def produce(endpoint: str, seconds: float = 4.0, interval_ms: int = 250, world: int = 2,
            runs: int = 1) -> list:
    """Emit ``runs`` synthetic runs at once (same host and job, their GPUs idle for
    different shares of the step) to ``endpoint`` (OTLP/gRPC) for ``seconds``; returns
    their run ids."""
    run_ids = [f"synthetic-{uuid.uuid4()}" for _ in range(runs)]
    ranks = [_Rank(endpoint, run_id, r, world, interval_ms, idle=0.25 if i == 0 else 0.05)
             for i, run_id in enumerate(run_ids) for r in range(world)]
    rng = random.Random(5)
    deadline = time.monotonic() + seconds
    index = 0
    while time.monotonic() < deadline:
        for rank in ranks:
            rank.run_step(index, rng)
        index += 1
        time.sleep(0.02)
    for rank in ranks:
        rank.shutdown()
    return run_ids
