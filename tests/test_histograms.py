"""The binned histogram path exports exactly what the SDK's own path would.

Each test records the same steps through ``StepMetrics`` twice: on a provider where
the ``HistogramBank`` attaches, and on one where it must not (a View is configured,
so the SDK records itself), then compares the collected points field by field.
"""

from __future__ import annotations

import random

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.metrics.view import (ExplicitBucketHistogramAggregation,
                                            ExponentialBucketHistogramAggregation, View)
from opentelemetry.sdk.trace import TracerProvider

from otel_training import semconv as sc
from otel_training.export.metrics import StepMetrics

COMMON = {"host.name": "node-a"}
PHASES = [("dataloader_next", "step"), ("forward", "train_batch"), ("backward", "train_batch"),
          ("untracked", "step")]


def _provider(delta: bool = False, views=(), **reader_kw):
    if delta:
        reader_kw["preferred_temporality"] = {Histogram: AggregationTemporality.DELTA}
    reader = InMemoryMetricReader(**reader_kw)
    return MeterProvider(metric_readers=[reader], views=list(views)), reader


def _metrics(provider, errors=None) -> StepMetrics:
    meter = provider.get_meter(sc.SCOPE, "1.0")
    return StepMetrics(meter, COMMON, provider, "1.0", (errors.append if errors is not None else None))


def _sdk_pair(delta: bool = False, **reader_kw):
    """(fast StepMetrics, its reader), (SDK-path StepMetrics, its reader)."""
    fast_provider, fast_reader = _provider(delta, **reader_kw)
    # A view that matches nothing still makes the bank stand aside.
    sdk_provider, sdk_reader = _provider(delta, views=[View(instrument_name="no.such.instrument")], **reader_kw)
    fast, sdk = _metrics(fast_provider), _metrics(sdk_provider)
    assert fast.bank is not None and sdk.bank is None
    return (fast, fast_reader), (sdk, sdk_reader)


def _record(m: StepMetrics, mode, duration_s, phases, idle, batch_size, context=None, end_ns=0) -> None:
    """One step through the per-step path: ``phases`` (name, parent) -> ns."""
    handles = [(m.phase_handle(mode, key), ns / 1e9) for key, ns in phases.items()]
    m.record_phases(mode, duration_s, handles, idle, batch_size, context, end_ns)


def _record_steps(targets, n: int, seed: int, mode: str = sc.MODE_TRAIN, context=None) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        phases = {key: rng.randrange(50_000, 400_000_000) for key in PHASES if rng.random() < 0.9}
        duration = sum(phases.values()) / 1e9
        for m in targets:
            _record(m, mode, duration, phases, None, 32, context, 1_700_000_000_000_000_000)
            m.flush()


def _histogram_points(reader) -> dict:
    """{(metric, sorted attributes): point} for the histograms of one collection."""
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name in (sc.METRIC_STEP_DURATION, sc.METRIC_PHASE_DURATION):
                    assert sm.scope.name == sc.SCOPE
                    for p in m.data.data_points:
                        out[(m.name, m.unit, m.data.aggregation_temporality,
                             tuple(sorted(p.attributes.items())))] = p
    return out


def _assert_same(fast_reader, sdk_reader) -> int:
    fast, sdk = _histogram_points(fast_reader), _histogram_points(sdk_reader)
    assert fast.keys() == sdk.keys()
    for key, p in sdk.items():
        q = fast[key]
        assert (q.count, list(q.bucket_counts), list(q.explicit_bounds)) == \
            (p.count, list(p.bucket_counts), list(p.explicit_bounds)), key
        assert q.sum == pytest.approx(p.sum, rel=1e-12)
        assert (q.min, q.max) == (p.min, p.max)
        assert q.start_time_unix_nano <= q.time_unix_nano
    return len(sdk)


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
@pytest.mark.parametrize("otlp_preference", [False, True], ids=["default", "explicit-buckets"])
def test_binned_points_equal_the_sdk_points(delta, otlp_preference):
    # The OTLP exporters prefer explicit buckets deferring to the instrument's advice.
    kw = {"preferred_aggregation": {Histogram: ExplicitBucketHistogramAggregation()}} if otlp_preference else {}
    (fast, fast_reader), (sdk, sdk_reader) = _sdk_pair(delta, **kw)
    # Enough steps that queued values are binned between collections too, and a
    # traced step (binned at once) between untraced ones.
    _record_steps([fast, sdk], 600, seed=1)
    with TracerProvider().get_tracer("t").start_as_current_span("step") as span:
        _record_steps([fast, sdk], 1, seed=5, context=trace.set_span_in_context(span))
    _record_steps([fast, sdk], 500, seed=6)
    assert _assert_same(fast_reader, sdk_reader) == 1 + len(PHASES)
    # A second interval: cumulative points grow, delta points hold only the new steps.
    _record_steps([fast, sdk], 40, seed=2)
    _record_steps([fast, sdk], 5, seed=3, mode=sc.MODE_EVAL)
    assert _assert_same(fast_reader, sdk_reader) == 2 * (1 + len(PHASES))
    if delta:  # nothing new: the SDK and the bank both leave the histograms out
        assert _histogram_points(fast_reader) == {} == _histogram_points(sdk_reader)


def test_values_on_a_bucket_bound_and_past_the_last_go_where_the_sdk_puts_them():
    (fast, fast_reader), (sdk, sdk_reader) = _sdk_pair()
    edges = [b * 1e9 for b in sc.DURATION_BUCKETS]  # ns, as phases are given
    values = edges + [e + 1 for e in edges] + [edges[-1] * 3, 1]
    random.Random(7).shuffle(values)
    for v in values:  # more than one bin_pending: values queue, then bin in bulk
        for m in (fast, sdk):
            _record(m, sc.MODE_TRAIN, v / 1e9, {PHASES[1]: v}, None, 1, None, 1_700_000_000_000_000_000)
    for m in (fast, sdk):
        m.flush()
    assert _assert_same(fast_reader, sdk_reader) == 2


def test_exemplars_name_the_traced_step():
    (fast, fast_reader), _ = _sdk_pair()
    tracer = TracerProvider().get_tracer("t")
    _record_steps([fast], 20, seed=4)
    with tracer.start_as_current_span("step") as span:
        context = trace.set_span_in_context(span)
    _record(fast, sc.MODE_TRAIN, 0.5, {key: 100_000_000 for key in PHASES}, None, 32, context,
                1_700_000_000_000_000_000)
    points = _histogram_points(fast_reader)
    exemplars = [e for p in points.values() for e in p.exemplars]
    assert len(exemplars) == len(points) == 1 + len(PHASES)  # one per series: the traced step
    ctx = span.get_span_context()
    assert {(e.trace_id, e.span_id) for e in exemplars} == {(ctx.trace_id, ctx.span_id)}
    step_point = next(p for k, p in points.items() if k[0] == sc.METRIC_STEP_DURATION)
    (exemplar,) = step_point.exemplars
    assert exemplar.time_unix_nano == 1_700_000_000_000_000_000
    # Exemplars go out once: the next collection has none.
    assert not [e for p in _histogram_points(fast_reader).values() for e in p.exemplars]


def test_stands_aside_where_it_would_not_be_exact():
    _, reader = _provider()
    exp_provider, _ = _provider(preferred_aggregation={Histogram: ExponentialBucketHistogramAggregation()})
    assert _metrics(exp_provider).bank is None
    view_provider, _ = _provider(views=[View(instrument_name="*")])
    assert _metrics(view_provider).bank is None
    other_buckets, _ = _provider(preferred_aggregation={Histogram: ExplicitBucketHistogramAggregation([1.0, 2.0])})
    assert _metrics(other_buckets).bank is None
    no_min_max, _ = _provider(preferred_aggregation={
        Histogram: ExplicitBucketHistogramAggregation(record_min_max=False)})
    assert _metrics(no_min_max).bank is None
    same_buckets, _ = _provider(preferred_aggregation={
        Histogram: ExplicitBucketHistogramAggregation(list(sc.DURATION_BUCKETS))})
    assert _metrics(same_buckets).bank is not None
    no_readers = MeterProvider()
    assert _metrics(no_readers).bank is None
    from opentelemetry.metrics import NoOpMeterProvider

    noop = NoOpMeterProvider()
    assert StepMetrics(noop.get_meter("x"), COMMON, noop).bank is None


def test_one_bank_per_provider_across_reinstrumentation():
    provider, reader = _provider()
    first = _metrics(provider)
    _record_steps([first], 10, seed=6)
    second = _metrics(provider)  # uninstrument + instrument again with the same provider
    assert second.bank is first.bank
    _record_steps([second], 5, seed=7)
    points = _histogram_points(reader)
    (step,) = [p for k, p in points.items() if k[0] == sc.METRIC_STEP_DURATION]
    assert step.count == 15  # one cumulative series, as the SDK's instrument would keep


def test_our_bug_at_collection_loses_nothing_of_the_sdk(monkeypatch):
    provider, reader = _provider()
    errors: list = []
    m = _metrics(provider, errors)
    _record_steps([m], 3, seed=8)
    monkeypatch.setattr(type(m.bank), "collect", lambda self, state: 1 / 0)
    data = reader.get_metrics_data()
    names = {metric.name for rm in data.resource_metrics for sm in rm.scope_metrics for metric in sm.metrics}
    assert sc.METRIC_STEPS in names  # the SDK's own counters still go out
    assert len(errors) == 1 and isinstance(errors[0], ZeroDivisionError)


@pytest.mark.parametrize("preference", ["cumulative", "delta"])
def test_the_sdk_configurators_setup_takes_the_binned_path(monkeypatch, preference):
    """What ``opentelemetry-instrument`` builds (a periodic reader, the OTLP exporter,
    its temporality preference) must not silently fall back to the slow path."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import MetricExportResult, PeriodicExportingMetricReader

    class Kept(OTLPMetricExporter):
        """The OTLP exporter as configured, keeping what it would send."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.sent: list = []

        def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
            self.sent.append(metrics_data)
            return MetricExportResult.SUCCESS

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", preference)
    exporter = Kept(endpoint="http://127.0.0.1:9", insecure=True)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader])
    try:
        m = _metrics(provider)
        assert m.bank is not None
        _record_steps([m], 3, seed=9)
        reader.force_flush()
        reader.force_flush()  # no new steps: a delta reader has nothing to send
        counts = [[p.count for rm in data.resource_metrics for sm in rm.scope_metrics for metric in sm.metrics
                   if metric.name == sc.METRIC_STEP_DURATION for p in metric.data.data_points]
                  for data in exporter.sent]
        assert counts == ([[3]] if preference == "delta" else [[3], [3]])
    finally:
        provider.shutdown(timeout_millis=100)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_child_forked_while_the_lock_is_held_can_still_collect():
    import os

    provider, reader = _provider()
    m = _metrics(provider)
    _record_steps([m], 3, seed=9)
    with m.bank.lock:  # the pipeline is mid-record when a DataLoader worker forks
        pid = os.fork()
        if pid == 0:  # the child: collect as the SDK does at exit, under a watchdog
            import signal

            signal.alarm(10)
            ok = bool(_histogram_points(reader))
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_untraced_steps_queued_by_the_pipeline_match_the_run_summary(instrumented):
    """Untraced steps skip the per-step recording: their values are queued on the
    series and binned in bulk. Per phase, the histograms must hold every step (traced
    or not, across collections): the summary's totals and the FLOP-count step it
    leaves out."""
    import torch
    from torch.utils.data import DataLoader

    from tests.conftest import make_dataset, make_model, train_step

    tel = instrumented(trace_every_n=5, trace_slow_factor=0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    for epoch in range(3):
        for batch in DataLoader(make_dataset(40), batch_size=4):
            train_step(model, opt, batch)
            steps += 1
        tel.metrics()  # a collection between epochs: queued values binned then
    assert 0 < len(tel.steps()) < steps  # some traced, most not
    summary = tel.runtime.pipeline.summary.to_dict()["modes"]["train"]
    assert summary["steps"] == steps
    # The step FLOPs were counted on is in the histograms as it ran, and out of the
    # summary's step times and phases (docs/telemetry.md): the histograms hold it on
    # top of the summary's totals, one more step per phase.
    assert summary["timed_steps"] == steps - 1
    counted_s = summary["flops"]["counted_step_s"]
    assert counted_s > 0
    (step_point,) = tel.points(sc.METRIC_STEP_DURATION)
    assert step_point.count == steps
    assert step_point.value == pytest.approx(summary["step_time_s"] + counted_s, rel=1e-9)
    counted_top = 0.0  # the counted step's top-level phases: its whole step time
    for phase in summary["phases"]:
        (point,) = tel.points(sc.METRIC_PHASE_DURATION, {sc.ATTR_PHASE: phase["name"],
                                                         sc.ATTR_PHASE_PARENT: phase["parent"]})
        assert point.count == phase["count"] + 1, phase
        extra = point.value - phase["total_s"]
        assert -1e-9 <= extra <= counted_s + 1e-9, phase
        if phase["parent"] == "step":
            counted_top += extra
        assert sum(point.data.bucket_counts) == point.count
    assert counted_top == pytest.approx(counted_s, abs=1e-9)
