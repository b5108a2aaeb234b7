"""End to end: an unmodified training script under ``opentelemetry-instrument``,
exporting over real OTLP/gRPC to a receiver on loopback."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.otlp_receiver import OTLPReceiver, attributes, data_points

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BATCH_DELAY_MS = 25.0
LOG_DELAY_MS = 8.0
STEPS = 30

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run():
    with OTLPReceiver() as receiver:
        env = dict(os.environ)
        env.update({
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_SERVICE_NAME": "e2e-train",
            "OTEL_PYTHON_DISTRO": "otel_training",
            "OTEL_PYTHON_CONFIGURATOR": "otel_training",
            "OTEL_TRAINING_TRACE_EVERY_N": "1",
            "OTEL_TRAINING_TRACE_MAX_PER_SECOND": "1000",
            "OTEL_METRIC_EXPORT_INTERVAL": "500",
        })
        proc = subprocess.run(
            [str(BIN / "opentelemetry-instrument"), sys.executable, str(ROOT / "examples" / "train_basic.py"),
             "--steps", str(STEPS), "--batch-delay-ms", str(BATCH_DELAY_MS), "--log-delay-ms", str(LOG_DELAY_MS)],
            env=env, capture_output=True, text=True, timeout=240, cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr
        assert "done" in proc.stdout
        assert "Traceback" not in proc.stderr, proc.stderr
        receiver.wait_for(lambda r: any(m.name == "training.step.duration" for _, m in r.metrics()))
        receiver.planted = json.loads(proc.stdout.splitlines()[-2])
        yield receiver


def _traces(receiver):
    by_trace = {}
    for res, span in receiver.spans():
        by_trace.setdefault(span.trace_id, []).append((res, span))
    return by_trace


def test_every_step_is_a_trace_with_phase_children(run):
    traces = _traces(run)
    assert len(traces) == STEPS
    for spans in traces.values():
        by_id = {s.span_id: s for _, s in spans}
        roots = [s for _, s in spans if not s.parent_span_id]
        assert len(roots) == 1 and roots[0].name == "step"
        names = {s.name for _, s in spans}
        assert {"dataloader_next", "to_device", "train_batch", "forward", "backward",
                "optimizer_step", "step_lr_schedulers", "from_device"} <= names
        for _, s in spans:
            if s.name in ("forward", "backward", "optimizer_step"):
                assert by_id[s.parent_span_id].name == "train_batch"
            elif s.name != "step":
                assert by_id[s.parent_span_id].name == "step"


def test_resource_and_attributes(run):
    res, span = next((r, s) for r, s in run.spans() if s.name == "step")
    assert res["service.name"] == "e2e-train"
    assert res["service.instance.id"] and res["training.run.id"] and res["host.name"]
    attrs = attributes(span.attributes)
    assert attrs["training.mode"] == "train" and attrs["training.batch_size"] == 16
    assert attrs["host.name"] == res["host.name"]


def test_phases_add_up_to_the_step(run):
    for spans in _traces(run).values():
        root = next(s for _, s in spans if s.name == "step")
        top = [s for _, s in spans if s.parent_span_id == root.span_id]
        covered = sum(s.end_time_unix_nano - s.start_time_unix_nano for s in top)
        untracked = attributes(root.attributes)["training.untracked.duration"] * 1e9
        total = root.end_time_unix_nano - root.start_time_unix_nano
        assert abs(covered + untracked - total) < 2_000  # ns; float rounding only
        for s in top:  # phases lie inside the step and do not overlap
            assert root.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano <= root.end_time_unix_nano


def test_planted_delays_are_recovered_within_10_percent(run):
    traces = list(_traces(run).values())[1:]  # the first step also starts the iterator
    loader = [s.end_time_unix_nano - s.start_time_unix_nano for spans in traces for _, s in spans
              if s.name == "dataloader_next"]
    untracked = [attributes(s.attributes)["training.untracked.duration"] for spans in traces
                 for _, s in spans if s.name == "step"]
    planted = run.planted  # the delays as they really happened in the script
    assert planted["batch_delay_ms"] >= BATCH_DELAY_MS and planted["log_delay_ms"] >= LOG_DELAY_MS
    # The wait holds the planted sleep and the rest of the fetch (the samples, the collate),
    # which a loaded machine stretches: the script's clock bounds both sides (above: each
    # wait as the loop saw it, from the end of one step's body to the start of the next).
    wait_ms = statistics.median(loader) / 1e6
    seen_ms = statistics.median(planted["wait_ms"][1:])
    assert planted["batch_delay_ms"] * 0.9 <= wait_ms <= seen_ms * 1.1 + 1.0, (wait_ms, planted)
    # untracked: the slow log line, and loss.item() and zero_grad() beside it
    assert planted["log_delay_ms"] * 0.9 <= statistics.median(untracked) * 1e3 <= planted["log_delay_ms"] * 1.1 + 1.0


def _latest_points(receiver, name):
    found = [m for _, m in receiver.metrics() if m.name == name]
    assert found, f"no {name} received"
    return data_points(found[-1])  # cumulative: the last export holds the totals


def test_metrics_for_every_step(run):
    (step_point,) = _latest_points(run, "training.step.duration")
    assert step_point.count == STEPS
    assert list(step_point.explicit_bounds)[:3] == [0.0001, 0.00025, 0.0005]
    steps = _latest_points(run, "training.steps")
    assert sum(p.as_int for p in steps) == STEPS
    samples = _latest_points(run, "training.samples")
    assert sum(p.as_int for p in samples) == STEPS * 16
    phases = {attributes(p.attributes)["training.phase"]: p for p in _latest_points(run, "training.phase.duration")}
    assert {"dataloader_next", "train_batch", "forward", "backward", "optimizer_step", "untracked"} <= set(phases)
    top = [p for p in phases.values() if attributes(p.attributes)["training.phase.parent"] == "step"]
    assert sum(p.sum for p in top) == pytest.approx(step_point.sum, rel=1e-6)
    loader = phases["dataloader_next"]
    # The mean holds every wait, the first's iterator start and a loaded machine's slowest
    # fetches: above, the mean of the loop's own clock around each (a median leaves them out).
    mean_ms = loader.sum / loader.count * 1e3
    seen_ms = statistics.mean(run.planted["wait_ms"])
    assert run.planted["batch_delay_ms"] * 0.9 <= mean_ms <= seen_ms * 1.1 + 1.0, (mean_ms, run.planted)
    for p in phases.values():
        attrs = attributes(p.attributes)
        assert attrs["host.name"] and attrs["training.mode"] == "train"


def test_exemplars_link_metrics_to_traces(run):
    # Exemplars are reset at each collection, so look across every export.
    exemplars = [e for _, m in run.metrics() if m.name == "training.step.duration"
                 for p in data_points(m) for e in p.exemplars]
    trace_ids = {s.trace_id for _, s in run.spans()}
    assert exemplars, "histogram points carry exemplars of traced steps"
    assert all(e.trace_id in trace_ids for e in exemplars)
