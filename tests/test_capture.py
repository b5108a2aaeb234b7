"""Tail capture: which steps become traces (first, slow, one in N, errors), under a
token bucket; metrics count every step regardless."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from otel_training.aggregate.sampling import TailCapture
from tests.conftest import make_dataset, make_model, spin, train_step

MS = 1_000_000
ROOT = Path(__file__).resolve().parents[1]


# -- the decision alone, on a synthetic clock ---------------------------------------------
def test_decide_first_sampled_slow_error():
    cap = TailCapture(slow_factor=2.0, every_n=5, max_per_second=1e6)
    now = 0
    reasons = []
    for i in range(30):
        dur = 10 * MS
        if i == 17:
            dur = 25 * MS  # > 2 x median
        if i == 18:
            dur = 19 * MS  # not slow enough
        now += dur
        reasons.append(cap.decide("train", dur, now, error=(i == 22)))
    assert reasons[0] == "first"
    assert reasons[17] == "slow"
    assert reasons[22] == "error"
    assert [i for i, r in enumerate(reasons) if r == "sampled"] == [5, 10, 15, 20, 25]
    assert [i for i, r in enumerate(reasons) if r is None] == [
        i for i in range(30) if i not in (0, 5, 10, 15, 17, 20, 22, 25)]


def test_slow_needs_a_warm_median_per_mode():
    cap = TailCapture(slow_factor=2.0, every_n=0, max_per_second=1e6)
    now = 0
    out = []
    for i in range(9):  # fewer than the warm-up: nothing is "slow" yet
        now += 10 * MS
        out.append(cap.decide("train", 10 * MS, now, False))
    now += 100 * MS
    out.append(cap.decide("train", 100 * MS, now, False))
    assert out == ["first"] + [None] * 9
    for i in range(12):
        now += 1 * MS
        cap.decide("eval", 1 * MS, now, False)
    now += 15 * MS  # slow for eval (1 ms median) though fast for train
    assert cap.decide("eval", 15 * MS, now, False) == "slow"
    now += 15 * MS
    assert cap.decide("train", 15 * MS, now, False) is None


def test_token_bucket_limits_and_refills():
    cap = TailCapture(slow_factor=0, every_n=0, max_per_second=4)
    now = 0
    taken = []
    for i in range(20):  # 20 failing steps in 20 ms: the bucket (4) empties
        now += 1 * MS
        taken.append(cap.decide("train", 1 * MS, now, True))
    assert sum(r is not None for r in taken) == 4
    now += 500 * MS  # half a second at 4/s: two more
    more = [cap.decide("train", 1 * MS, now + i, True) for i in range(5)]
    assert sum(r is not None for r in more) == 2
    now += 10_000 * MS  # a long pause refills to the cap only
    more = [cap.decide("train", 1 * MS, now + i, True) for i in range(10)]
    assert sum(r is not None for r in more) == 4  # errors too are rate limited


def test_one_in_n_leaves_half_the_bucket_to_slow_steps_and_errors():
    cap = TailCapture(slow_factor=2.0, every_n=1, max_per_second=4)
    now = 0
    reasons = []
    for i in range(40):  # every step is due a one-in-N trace: 40 in 40 ms
        now += 1 * MS
        reasons.append(cap.decide("train", 1 * MS, now, False))
    assert reasons[0] == "first"
    # one-in-N takes only the tokens above half the bucket (4): after the first, one
    assert reasons.count("sampled") == 1
    assert sum(r is None for r in reasons) == 38
    # ... which a burst of slow steps and errors can still use, one-in-N could not
    now += 1 * MS
    assert cap.decide("train", 5 * MS, now, False) == "slow"
    now += 1 * MS
    assert cap.decide("train", 1 * MS, now, True) == "error"
    now += 1 * MS
    assert cap.decide("train", 5 * MS, now, True) is None  # the bucket is empty now
    # one-in-N resumes once refills bring the bucket back to half
    now += 600 * MS  # 2.4 tokens: not above half plus one
    assert cap.decide("train", 1 * MS, now, False) is None
    now += 200 * MS  # 3.2 tokens
    assert cap.decide("train", 1 * MS, now, False) == "sampled"


# -- on real loops -----------------------------------------------------------------------
def _run(steps, delay=0.0, slow_at=(), slow_delay=0.0):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(make_dataset(steps * 2), batch_size=2)
    for i, batch in enumerate(loader):
        train_step(model, opt, batch)
        spin(slow_delay if i in slow_at else delay)


def test_only_the_first_step_by_default_and_metrics_count_all(instrumented):
    tel = instrumented(trace_every_n=100, trace_slow_factor=0)
    _run(12)
    steps = tel.steps()
    assert [(s.index, s.attributes["training.trace.reason"]) for s in steps] == [(0, "first")]
    (point,) = tel.points("training.step.duration")
    assert point.count == 12
    assert sum(p.value for p in tel.points("training.steps")) == 12


def test_one_in_n(instrumented):
    tel = instrumented(trace_every_n=4, trace_slow_factor=0)
    _run(10)
    assert [(s.index, s.attributes["training.trace.reason"]) for s in tel.steps()] == [
        (0, "first"), (4, "sampled"), (8, "sampled")]


def test_slow_steps_are_traced(instrumented):
    tel = instrumented(trace_every_n=0, trace_slow_factor=2.0)
    _run(16, delay=0.02, slow_at=(13,), slow_delay=0.2)
    traced = {s.index: s for s in tel.steps()}
    assert traced.pop(0).attributes["training.trace.reason"] == "first"
    slow = traced.pop(13)
    assert slow.attributes["training.trace.reason"] == "slow"
    # the slow step's trace shows where the time went: user code after the step's phases
    assert slow.attributes["training.untracked.duration"] >= 0.2
    for other in traced.values():  # only a step that really ran slow (a loaded machine)
        assert other.attributes["training.trace.reason"] == "slow"
        assert other.duration > 2 * 0.02


def test_token_bucket_on_a_real_loop(instrumented):
    import time

    tel = instrumented(trace_every_n=1, trace_slow_factor=0, trace_max_per_second=3)
    t0 = time.perf_counter()
    _run(20)
    elapsed = time.perf_counter() - t0
    traced = tel.steps()
    # the first step, then one-in-N from the bucket's upper half, plus what refilled
    # at 3/s meanwhile -- far fewer than 20
    assert 1 <= len(traced) <= 3 + int(elapsed * 3) + 1 < 20
    (point,) = tel.points("training.step.duration")
    assert point.count == 20


def test_errors_are_traced_and_propagate_unchanged(instrumented):
    tel = instrumented(trace_every_n=0, trace_slow_factor=0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raised = []
    for i, (x, y) in enumerate(DataLoader(make_dataset(12), batch_size=2)):
        if i == 3:
            x = torch.randn(2, 5)  # wrong width: the forward raises
        try:
            train_step(model, opt, (x, y))
        except RuntimeError as exc:
            raised.append(exc)
    assert len(raised) == 1 and "shapes cannot be multiplied" in str(raised[0])
    steps = tel.steps()
    # the step that failed in its forward ran no backward: eval step 0 (train steps 0-2 before it)
    assert [(s.mode, s.index, s.attributes["training.trace.reason"]) for s in steps] == [
        ("train", 0, "first"),
        ("eval", 0, "error"),
    ]
    failed = steps[1]
    assert failed.root.status.status_code.name == "ERROR"
    (event,) = failed.root.events
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "RuntimeError"
    assert failed.named("forward")  # the failed forward is still timed
    assert steps[0].root.status.status_code.name == "UNSET"


def test_error_in_the_dataset_propagates_and_marks_the_step(instrumented):
    from torch.utils.data import Dataset

    boom = LookupError("bad sample")

    class Bad(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i == 5:
                raise boom
            return torch.randn(8)

    tel = instrumented(trace_every_n=0, trace_slow_factor=0)
    model = make_model()
    with pytest.raises(LookupError) as info:
        for x in DataLoader(Bad(), batch_size=2):
            model(x)
    assert info.value is boom
    tel.uninstrument()  # ends the open (failed) step
    steps = tel.steps()
    assert [(s.index, s.attributes["training.trace.reason"]) for s in steps] == [(0, "first"), (2, "error")]
    assert steps[1].top_level() == ["dataloader_next"]
    assert steps[1].root.status.status_code.name == "ERROR"


def test_error_in_backward(instrumented):
    tel = instrumented(trace_every_n=0, trace_slow_factor=0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(make_dataset(8), batch_size=2)
    for i, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if i == 1:
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()
        if i == 2:
            with pytest.raises(RuntimeError, match="does not require grad"):
                torch.autograd.backward(torch.ones(1))
        opt.step()
    steps = tel.steps()
    assert [(s.index, s.attributes["training.trace.reason"]) for s in steps] == [
        (0, "first"), (1, "error"), (2, "error")]
    for s in steps[1:]:
        assert s.top_level().count("train_batch") == 1  # the failed backward is timed in place
        assert len(s.named("backward")) == 2


def test_uncaught_exception_in_user_code_marks_the_last_step(tmp_path):
    """A script that dies with an exception raised by plain user code (no hook
    saw it): the open step is ended at exit with status ERROR."""
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent("""
        import atexit, dataclasses, json, sys
        import torch
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from otel_training.config import load_config
        from otel_training.instrumentor import TrainingInstrumentor

        exporter = InMemorySpanExporter()
        tp = TracerProvider()
        tp.add_span_processor(SimpleSpanProcessor(exporter))

        def report():  # registered first, so it runs after the instrumentation's own exit hook
            roots = [s for s in exporter.get_finished_spans() if s.parent is None]
            print(json.dumps([[s.attributes["training.step"], s.status.status_code.name,
                               [e.attributes.get("exception.type") for e in s.events]] for s in roots]))

        atexit.register(report)
        cfg = dataclasses.replace(load_config({}), trace_every_n=1, hardware=False, integrations=())
        TrainingInstrumentor().instrument(tracer_provider=tp, meter_provider=MeterProvider(), config=cfg)
        model = torch.nn.Linear(4, 2)
        for i, x in enumerate(torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)):
            model(x)
            if i == 2:
                raise ZeroDivisionError("user code")
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert "ZeroDivisionError: user code" in proc.stderr
    roots = json.loads(proc.stdout.strip().splitlines()[-1])
    assert roots == [[0, "UNSET", []], [1, "UNSET", []], [2, "ERROR", ["ZeroDivisionError"]]]


def test_flush_returns_only_once_the_counters_are_added(instrumented, monkeypatch):
    """The pipeline adds a batch's step and sample counters after its steps; a flush
    must wait for that too, or a collection right after it misses them."""
    from otel_training.export.metrics import StepMetrics

    slow_flush = StepMetrics.flush

    def flush(self):
        time.sleep(0.05)  # a slow moment between the last step and the counters
        slow_flush(self)

    monkeypatch.setattr(StepMetrics, "flush", flush)
    tel = instrumented(trace_every_n=0, trace_slow_factor=0)
    for rounds in (1, 2):
        _run(6)
        tel.flush()
        # read straight from the reader: tel.points() would flush again
        data = tel.metric_reader.get_metrics_data()
        steps = sum(dp.value for rm in data.resource_metrics for sm in rm.scope_metrics
                    for m in sm.metrics if m.name == "training.steps" for dp in m.data.data_points)
        assert steps == 6 * rounds
