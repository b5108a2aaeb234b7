"""Untraced steps are queued for the histograms a layout run at a time
(``export/layout_queues.py``); traced steps one by one, with exemplars. Both give
exactly the same run summary and the same histogram points."""

from __future__ import annotations

import random

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from otel_training import semconv as sc
from otel_training.aggregate import step_record as record_mod
from otel_training.aggregate.pipeline import Pipeline
from otel_training.aggregate.sampling import TailCapture
from otel_training.aggregate.summary import RunSummary
from otel_training.export.metrics import StepMetrics
from otel_training.export.selftelemetry import SelfTelemetry
from otel_training.export.spans import StepSpans
from otel_training.record.step_assembly import StepAssembler
from otel_training.record.tracker import Tracker
from otel_training.timing.device import DeviceTimer
from tests.conftest import EndedSpans


class _Clock:
    """A synthetic perf_counter_ns: every read advances by a random amount."""

    def __init__(self, seed: int) -> None:
        self.now = 1_000_000_000
        self.rng = random.Random(seed)

    def __call__(self) -> int:
        self.now += self.rng.randrange(1_000, 3_000_000)
        return self.now


def _pipeline(trace_all: bool):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics = StepMetrics(provider.get_meter(sc.SCOPE, "1"), {"host.name": "h"}, provider, "1")
    assert metrics.bank is not None  # binned histograms: untraced steps go by layout run
    telemetry = SelfTelemetry()
    # Every step traced (one by one, with exemplars), or only the first.
    capture = TailCapture(0, 1, 1e12) if trace_all else TailCapture(0, 0, 1e9)
    tracer_provider = TracerProvider()
    made = EndedSpans()
    tracer_provider.add_span_processor(made)
    pipeline = Pipeline(spans=StepSpans(tracer_provider.get_tracer("t"), {}, 0), metrics=metrics,
                        capture=capture, summary=RunSummary({}, "off"), timer=DeviceTimer(),
                        telemetry=telemetry, offset=0)
    return pipeline, reader, telemetry, made


def _run(tracker: Tracker, seed: int) -> None:
    """Steps of several layouts, as hooks would report them: plain steps, gradient
    accumulation (two forwards and backwards), eval steps, user phases (one named
    "step"), a phase left open, and many one-off layouts."""
    rng = random.Random(seed)
    for i in range(400):
        tracker.start_step()
        kinds = ["plain", "accum", "eval", "user", "open", "plain", "plain", "odd"]
        kind = kinds[i] if i < len(kinds) else rng.choice(kinds)  # each layout known early
        tracker.begin_phase(sc.PHASE_DATALOADER_NEXT, auto=True)
        tracker.end_phase(sc.PHASE_DATALOADER_NEXT)
        if kind == "odd":  # a different number of reads every step: new layouts
            for _ in range(i % 90):
                tracker.begin_phase(sc.PHASE_FROM_DEVICE, auto=True)
                tracker.end_phase(sc.PHASE_FROM_DEVICE)
        for _ in range(2 if kind == "accum" else 1):
            tracker.forward_begin()
            tracker.end_phase(sc.PHASE_FORWARD)
            if kind != "eval":
                tracker.backward_begin()
                tracker.end_phase(sc.PHASE_BACKWARD)
        if kind != "eval":
            tracker.end_record(tracker.optimizer_begin())
        if kind == "user":
            tracker.begin_phase("step")
            tracker.begin_phase("log")
            tracker.end_phase("log")
            tracker.end_phase("step")
        if kind == "open":
            tracker.begin_phase("checkpoint")
        tracker.finish_step()


def _points(reader) -> dict:
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    key = (m.name, tuple(sorted(p.attributes.items())))
                    if hasattr(p, "bucket_counts"):
                        out[key] = (p.count, list(p.bucket_counts), round(p.sum, 9), p.min, p.max)
                    else:
                        out[key] = p.value
    return out


def test_steps_by_layout_run_add_up_as_steps_one_by_one(monkeypatch):
    monkeypatch.setattr(record_mod, "_MAX_LAYOUTS", 8)  # the one-off layouts overflow it
    results = []
    for trace_all in (False, True):
        pipeline, reader, telemetry, made = _pipeline(trace_all)
        tracker = Tracker(StepAssembler(pipeline.submit), DeviceTimer(), clock=_Clock(seed=3))
        _run(tracker, seed=11)
        assert pipeline.flush(5.0)  # no thread started: drains here
        summary = pipeline.summary.to_dict()
        for mode in summary["modes"].values():
            mode["phases"].sort(key=lambda p: (p["name"], p["parent"]))
        results.append((summary["modes"], _points(reader)))
        assert (made.count > 400) == trace_all
        assert sum(telemetry.errors.values()) == 0
    (modes, points), (modes_1by1, points_1by1) = results
    assert modes == modes_1by1
    assert points == points_1by1
    phases = {(p["name"], p["parent"]) for p in modes[sc.MODE_TRAIN]["phases"]}
    assert {("forward", "train_batch"), ("log", "step"), ("untracked", "step"),
            ("checkpoint", "step")} <= phases
    hist = [k for k in points if k[0] == sc.METRIC_PHASE_DURATION]
    assert len(hist) == len(phases) + len(modes[sc.MODE_EVAL]["phases"])


def test_the_summary_keeps_a_bounded_sample_of_durations(monkeypatch):
    from otel_training.aggregate import summary as summary_mod

    monkeypatch.setattr(summary_mod, "_MAX_DURATIONS", 100)
    pipeline, _, _, _ = _pipeline(False)
    clock = iter(range(1_000, 10**9, 1_000))
    tracker = Tracker(StepAssembler(pipeline.submit), DeviceTimer(), clock=lambda: next(clock))
    for _ in range(650):
        tracker.start_step()
        tracker.end_record(tracker.optimizer_begin())
        tracker.finish_step()
    assert pipeline.flush(5.0)
    train = pipeline.summary.to_dict()["modes"][sc.MODE_TRAIN]
    assert train["steps"] == 650
    assert train["step_p50_s"] == train["step_max_s"] == 3e-6  # three clock reads a step
    assert abs(train["wall_s"] - (650 * 4 - 1) * 1e-6) < 1e-12  # and a clock read between steps
