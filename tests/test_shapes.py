"""Steps queued by shape (``otel_training/shapes.py``) give exactly what the
per-step path gives: the same run summary and the same histogram points."""

from __future__ import annotations

import random

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from otel_training import semconv as sc
from otel_training import shapes as shapes_mod
from otel_training.capture import TailCapture
from otel_training.device_timing import DeviceTimer
from otel_training.emit.metrics import StepMetrics
from otel_training.pipeline import Pipeline
from otel_training.selftelemetry import SelfTelemetry
from otel_training.summary import RunSummary
from otel_training.tracker import Tracker


class _Clock:
    """A synthetic perf_counter_ns: every read advances by a random amount."""

    def __init__(self, seed: int) -> None:
        self.now = 1_000_000_000
        self.rng = random.Random(seed)

    def __call__(self) -> int:
        self.now += self.rng.randrange(1_000, 3_000_000)
        return self.now


def _pipeline(by_shape: bool):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics = StepMetrics(provider.get_meter(sc.SCOPE, "1"), {"host.name": "h"}, provider, "1")
    assert metrics.fast
    pipeline = Pipeline(tracer=TracerProvider().get_tracer("t"), metrics=metrics,
                        capture=TailCapture(0, 10, 1e9), summary=RunSummary({}, "off"),
                        timer=DeviceTimer(), telemetry=SelfTelemetry(), span_attributes={})
    assert pipeline._shapes is not None  # binned histograms: steps go by shape
    if not by_shape:
        pipeline._shapes = None
    return pipeline, reader


def _run(tracker: Tracker, seed: int) -> None:
    """Steps of several shapes, as hooks would report them: plain steps, gradient
    accumulation (two forwards and backwards), eval steps, user phases (one named
    "step"), a phase left open, and many one-off shapes."""
    rng = random.Random(seed)
    for i in range(400):
        tracker.start_step()
        kinds = ["plain", "accum", "eval", "user", "open", "plain", "plain", "odd"]
        kind = kinds[i] if i < len(kinds) else rng.choice(kinds)  # each shape known early
        tracker.begin_phase(sc.PHASE_DATALOADER_NEXT, auto=True)
        tracker.end_phase(sc.PHASE_DATALOADER_NEXT)
        if kind == "odd":  # a different number of reads every step: new shapes
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


def test_steps_by_shape_add_up_as_steps_one_by_one(monkeypatch):
    monkeypatch.setattr(shapes_mod, "_MAX_SHAPES", 8)  # the one-off shapes overflow it
    results = []
    for by_shape in (True, False):
        pipeline, reader = _pipeline(by_shape)
        tracker = Tracker(pipeline.submit, DeviceTimer(), clock=_Clock(seed=3))
        _run(tracker, seed=11)
        assert pipeline.flush(5.0)  # no thread started: drains here
        summary = pipeline.summary.to_dict()
        for mode in summary["modes"].values():
            mode["phases"].sort(key=lambda p: (p["name"], p["parent"]))
        results.append((summary["modes"], _points(reader)))
        if by_shape:
            shapes = pipeline._shapes._shapes
            assert len(shapes[sc.MODE_TRAIN]) == 8  # bounded; the rest went one by one
            assert None in shapes[sc.MODE_TRAIN].values()  # the shape with a phase named "step"
            assert any(s is not None for s in shapes[sc.MODE_EVAL].values())
    (modes, points), (modes_1by1, points_1by1) = results
    assert modes == modes_1by1
    assert points == points_1by1
    phases = {(p["name"], p["parent"]) for p in modes[sc.MODE_TRAIN]["phases"]}
    assert {("forward", "train_batch"), ("log", "step"), ("untracked", "step"),
            ("checkpoint", "step")} <= phases
    hist = [k for k in points if k[0] == sc.METRIC_PHASE_DURATION]
    assert len(hist) == len(phases) + len(modes[sc.MODE_EVAL]["phases"])


def test_the_summary_keeps_a_bounded_sample_of_durations_in_both_paths(monkeypatch):
    from otel_training import summary as summary_mod

    monkeypatch.setattr(summary_mod, "_MAX_DURATIONS", 100)
    s = RunSummary({}, "off")
    s.add_steps(sc.MODE_TRAIN, 5_000, 9_000, [7] * 500, 1000)  # a later batch, added first
    for i in range(150):
        s.add_step(sc.MODE_TRAIN, i * 10, i * 10 + 5, None, 2)
    m = s.modes[sc.MODE_TRAIN]
    assert 50 <= len(m.durations) <= 100
    assert (m.steps, m.samples, m.step_ns) == (650, 1300, 500 * 7 + 150 * 5)
    assert (m.first_start, m.last_end) == (0, 9_000)  # out of order: the span is min..max
