"""Shared test fixtures: instrument a real torch loop against the real OpenTelemetry
SDK with in-memory exporters, and read back what came out.

    def test_something(instrumented):
        tel = instrumented(trace_every_n=1)      # Config fields as keywords
        ... run a training loop ...
        steps = tel.steps()                      # one StepTrace per traced step
        points = tel.points("training.phase.duration", {"training.phase": "forward"})

``instrumented`` always uninstruments at teardown (also when the test fails); a
test may also call ``tel.uninstrument()`` itself (spans and metrics stay readable).
The defaults make every step traced and keep the hardware sampler and framework
integrations off; override any ``Config`` field by keyword.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, Iterable, List, Optional

import pytest

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# The tests marked `core`: step detection and the numbers built on it, the parts that
# depend on torch's hooks and internals (not the exporters, the trace file or the report,
# whose behaviour no torch release changes). scripts/test-torch-range.sh runs them on the lowest
# and the newest torch release the package supports (the whole suite runs on constraints.txt's).
CORE_MODULES = frozenset({
    "tests/loops/test_loops.py",
    "tests/test_steps.py", "tests/test_repeats.py", "tests/test_layouts.py", "tests/test_queued_steps.py",
    "tests/test_phases.py", "tests/test_phases_torch.py", "tests/test_phases_closure.py", "tests/test_attribution.py",
    "tests/test_throughput.py", "tests/test_flops.py", "tests/test_memory.py", "tests/test_compat.py",
    "tests/test_reliability_faults.py", "tests/test_reliability_shutdown.py", "tests/test_reliability_workers.py",
    "tests/test_reliability_restart.py",
    "tests/test_manual_api.py", "tests/test_preflight.py",
    "tests/test_integration_lightning.py", "tests/test_integration_transformers.py",
    # the job's wall time: checkpoint calls and torch.compile's compile events, per torch release
    "tests/test_goodput.py", "tests/test_goodput_integrations.py", "tests/loops/test_goodput_loop.py",
    # a restarted run: torchrun's restart environment, the frameworks' resumed global step
    "tests/test_attempts.py",
    # torch.profiler's API and its events, per torch release
    "tests/test_profiles.py",
})


# The tests marked `sdk_independent`: what they check lies below or beside the
# OpenTelemetry SDK (torch loop shapes, DDP, the GPU timeline, the report and compare
# commands, the stack's own processes, Alertmanager's routing, the shipped files), so
# scripts/test-sdk-lowest.sh leaves them out: run again on the lowest SDK they test nothing
# new. Everything that exports, configures or reads OpenTelemetry runs on both. The loop
# suite still runs on three set-ups: the newest SDK here, and both torch ends.
SDK_INDEPENDENT_MODULES = frozenset({
    "tests/loops/test_loops.py", "tests/loops/test_goodput_loop.py",
    "tests/test_grad_sync.py", "tests/test_gpu_timing.py", "tests/test_steps.py", "tests/test_memory.py",
    "tests/test_compat.py", "tests/test_repeats.py", "tests/test_layouts.py", "tests/test_flops.py",
    "tests/test_compare.py", "tests/test_html_report.py", "tests/test_report.py", "tests/test_verdict.py",
    "tests/test_verdict_ranks.py", "tests/test_summary_file.py", "tests/test_cli_help.py", "tests/test_layers.py",
    "tests/stack/test_alertmanager.py", "tests/stack/test_stack_cli.py", "tests/stack/test_static.py",
    "tests/stack/test_promtool.py", "tests/stack/test_queries.py", "tests/stack/test_grafana_npm.py",
    "tests/stack/test_grafana_schema.py", "tests/stack/test_grafana_intervals.py",
})


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        try:
            rel = item.path.relative_to(root).as_posix()
        except ValueError:
            continue
        if rel in CORE_MODULES:
            item.add_marker(pytest.mark.core)
        if rel in SDK_INDEPENDENT_MODULES:
            item.add_marker(pytest.mark.sdk_independent)


TEST_DEFAULTS = dict(
    trace_every_n=1,
    trace_max_per_second=1e6,
    hardware=False,
    gpu_timing="off",
    summary=False,
    summary_file=None,
    shutdown_timeout=10.0,
    integrations=(),
)


def _ns_to_s(ns: int) -> float:
    return ns / 1e9


def span_duration(span: ReadableSpan) -> float:
    """Seconds between a span's start and end."""
    return _ns_to_s(span.end_time - span.start_time)


class StepTrace:
    """One traced step: the root ``step`` span and every span under it."""

    def __init__(self, root: ReadableSpan, spans: List[ReadableSpan]) -> None:
        self.root = root
        self.spans = sorted(spans, key=lambda s: (s.start_time, -s.end_time))
        self._by_id = {s.context.span_id: s for s in self.spans}

    # -- navigation ---------------------------------------------------------------
    @property
    def attributes(self) -> dict:
        return dict(self.root.attributes)

    @property
    def index(self) -> int:
        return self.root.attributes.get("training.step")

    @property
    def mode(self) -> str:
        return self.root.attributes.get("training.mode")

    @property
    def duration(self) -> float:
        return span_duration(self.root)

    def parent_of(self, span: ReadableSpan) -> Optional[ReadableSpan]:
        return self._by_id.get(span.parent.span_id) if span.parent is not None else None

    def children(self, span: Optional[ReadableSpan] = None) -> List[ReadableSpan]:
        span = span or self.root
        sid = span.context.span_id
        return [s for s in self.spans if s.parent is not None and s.parent.span_id == sid]

    def named(self, name: str) -> List[ReadableSpan]:
        return [s for s in self.spans if s.name == name]

    def names(self) -> List[str]:
        return [s.name for s in self.spans if s is not self.root]

    def top_level(self) -> List[str]:
        """Names of the step's direct children, in time order."""
        return [s.name for s in self.children()]

    def tree(self, span: Optional[ReadableSpan] = None) -> tuple:
        """``(name, (child trees...))`` in time order: easy to compare in asserts."""
        span = span or self.root
        return (span.name, tuple(self.tree(c) for c in self.children(span)))

    def total(self, name: str) -> float:
        """Seconds spent in all spans called ``name``."""
        return sum(span_duration(s) for s in self.named(name))

    def __repr__(self) -> str:  # pragma: no cover - shows up in assertion messages
        return f"StepTrace(#{self.index} {self.mode} {self.tree()})"


class Point:
    """One metric data point, flattened: name, attributes and the SDK point."""

    def __init__(self, name: str, unit: str, attributes: dict, data: Any) -> None:
        self.name = name
        self.unit = unit
        self.attributes = attributes
        self.data = data

    @property
    def value(self):
        """Sum for histograms, value for counters and gauges."""
        return getattr(self.data, "sum", None) if hasattr(self.data, "bucket_counts") else self.data.value

    @property
    def count(self) -> Optional[int]:
        return getattr(self.data, "count", None)

    def __repr__(self) -> str:  # pragma: no cover
        return f"Point({self.name} {self.attributes} value={self.value} count={self.count})"


class Instrumented:
    """A live instrumentation with in-memory exporters."""

    def __init__(self, **overrides: Any) -> None:
        from otel_training import runtime as _runtime
        from otel_training.config import load_config
        from otel_training.instrumentor import TrainingInstrumentor

        options = dict(TEST_DEFAULTS)
        options.update(overrides)
        self.config = dataclasses.replace(load_config({}), **options)
        self.span_exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.span_exporter))
        self.metric_reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.metric_reader])
        self._instrumentor = TrainingInstrumentor()
        if self._instrumentor.is_instrumented_by_opentelemetry:
            raise RuntimeError("already instrumented: a previous test leaked its instrumentation")
        self._instrumentor.instrument(tracer_provider=self.tracer_provider,
                                      meter_provider=self.meter_provider, config=self.config)
        self.runtime = _runtime.current()
        self.active = True
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------
    @property
    def tracker(self):
        return self.runtime.tracker

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until the pipeline has turned every finished step into telemetry."""
        if self.runtime is not None:
            assert self.runtime.pipeline.flush(timeout), "pipeline did not drain"

    def uninstrument(self) -> None:
        """End the open step, flush, remove every hook (idempotent). Spans and
        metrics stay readable."""
        if self.active:
            self.active = False
            self._instrumentor.uninstrument()

    def close(self) -> None:
        """Uninstrument and shut the SDK providers down (the fixture's teardown)."""
        self.uninstrument()
        if not self._closed:
            self._closed = True
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown()

    def __enter__(self) -> "Instrumented":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- spans ----------------------------------------------------------------------
    def spans(self, name: Optional[str] = None) -> List[ReadableSpan]:
        self.flush()
        spans = list(self.span_exporter.get_finished_spans())
        return [s for s in spans if name is None or s.name == name]

    def steps(self) -> List[StepTrace]:
        """Every traced step, in time order (train and eval steps are numbered apart)."""
        spans = self.spans()
        by_trace: Dict[int, List[ReadableSpan]] = {}
        for s in spans:
            by_trace.setdefault(s.context.trace_id, []).append(s)
        out = []
        for group in by_trace.values():
            roots = [s for s in group if s.parent is None]
            assert len(roots) == 1, f"a trace with {len(roots)} roots: {[s.name for s in group]}"
            out.append(StepTrace(roots[0], group))
        out.sort(key=lambda t: t.root.start_time)
        return out

    # -- metrics --------------------------------------------------------------------
    def metrics(self) -> List[Point]:
        """Every data point collected so far (cumulative), flattened."""
        self.flush()
        data = self.metric_reader.get_metrics_data()
        out: List[Point] = []
        if data is None:
            return out
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for dp in metric.data.data_points:
                        out.append(Point(metric.name, metric.unit, dict(dp.attributes), dp))
        return out

    def points(self, name: str, where: Optional[dict] = None) -> List[Point]:
        """Data points of metric ``name`` whose attributes include ``where``."""
        where = where or {}
        return [p for p in self.metrics() if p.name == name
                and all(p.attributes.get(k) == v for k, v in where.items())]

    def phase_totals(self, parent: str = "step", mode: Optional[str] = None) -> Dict[str, float]:
        """``training.phase.duration`` sums by phase name, for one parent."""
        where = {"training.phase.parent": parent}
        if mode is not None:
            where["training.mode"] = mode
        out: Dict[str, float] = {}
        for p in self.points("training.phase.duration", where):
            name = p.attributes["training.phase"]
            out[name] = out.get(name, 0.0) + p.value
        return out


@pytest.fixture
def instrumented():
    """Factory: ``instrumented(**config_overrides)`` -> :class:`Instrumented`."""
    made: List[Instrumented] = []

    def start(**overrides: Any) -> Instrumented:
        tel = Instrumented(**overrides)
        made.append(tel)
        return tel

    try:
        yield start
    finally:
        for tel in made:
            tel.close()
        from otel_training.instrumentor import TrainingInstrumentor

        inst = TrainingInstrumentor()
        if inst.is_instrumented_by_opentelemetry:  # started behind the fixture's back
            inst.uninstrument()


# ---------------------------------------------------------------------------------
# Small torch building blocks shared by the phase tests.
# ---------------------------------------------------------------------------------

def make_model(width: int = 16, depth: int = 2):
    import torch

    layers: List[Any] = [torch.nn.Linear(8, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 2))
    return torch.nn.Sequential(*layers)


def make_dataset(n: int = 32, delay: float = 0.0):
    """A map-style dataset of (x[8], y) pairs whose __getitem__ sleeps ``delay`` s;
    ``dataset.slept`` lists the time each call really slept (single-process loading)."""
    import torch
    from torch.utils.data import Dataset

    class SleepyDataset(Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(n, 8, generator=g)
            self.y = torch.randint(0, 2, (n,), generator=g)
            self.slept: List[float] = []

        def __len__(self) -> int:
            return n

        def __getitem__(self, i):
            if delay:
                self.slept.append(spin(delay))
            return self.x[i], self.y[i]

    return SleepyDataset()


def train_step(model, opt, batch, loss_fn=None) -> float:
    """forward, loss, backward, optimizer step; returns the loss via .item()."""
    import torch

    x, y = batch
    out = model(x)
    loss = (loss_fn or torch.nn.functional.cross_entropy)(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def spin(seconds: float) -> float:
    """Sleep ``seconds`` (a planted delay); returns the time really slept, which on
    a loaded machine can be a little longer: compare measurements with that."""
    t0 = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - t0


def assert_planted(measured: float, planted: float, what: str = "", around: float = 0.0) -> None:
    """``measured`` holds the delay the script really slept (``planted``, less 10%) and at
    most ``around`` seconds more than 110% of it: the unplanted code beside the delay in
    the same phase, which waits for a core on a loaded machine. The low side is where a
    lost delay shows; ``around`` stays below any phase that could be misbooked there."""
    assert planted * 0.9 <= measured <= planted * 1.1 + around, (
        f"{what or 'value'}: measured {measured * 1e3:.2f} ms, the script slept {planted * 1e3:.2f} ms "
        f"(want {planted * 0.9e3:.2f} to {(planted * 1.1 + around) * 1e3:.2f} ms)")


def assert_close(measured: float, expected: float, rel: float = 0.10, what: str = "") -> None:
    """``measured`` within ``rel`` of ``expected`` (a planted delay recovered)."""
    assert abs(measured - expected) <= rel * expected, (
        f"{what or 'value'}: measured {measured * 1e3:.2f} ms, planted {expected * 1e3:.2f} ms "
        f"(tolerance {rel:.0%})")


def flatten(trees: Iterable[tuple]) -> List[str]:
    out: List[str] = []
    for name, kids in trees:
        out.append(name)
        out.extend(flatten(kids))
    return out


def reader_points(reader) -> dict:
    """{metric name: [(attributes, value)]} from one collection of an in-memory reader."""
    out: dict = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(
                    (dict(p.attributes), p.value) for p in m.data.data_points)
    return out


class EndedSpans(SpanProcessor):
    """Counts the spans ended on its tracer provider (every span made, exported or not)."""

    def __init__(self) -> None:
        self.count = 0

    def on_end(self, span: ReadableSpan) -> None:
        self.count += 1


def manual_steps(steps: int) -> None:
    """A tiny training loop driven by ``otel_training.step()`` (no DataLoader)."""
    import torch

    import otel_training

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        with otel_training.step():
            loss = model(torch.randn(4, 8)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()


def run_script_for_summary(tmp_path, source: str, timeout: float = 120, **env_overrides) -> tuple:
    """Run ``source`` as a script (exporters off, hardware off) with a run-end summary
    file; returns (summary dict, {train phase name: phase}). ``NAME=None`` unsets NAME."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(source)
    env = dict(os.environ, OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "s.json"), OTEL_TRAINING_HARDWARE="false",
               OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    for name, value in env_overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    return summary, {p["name"]: p for p in summary["modes"]["train"]["phases"]}
