"""A Collector restarted mid-run: a real OTLP/gRPC receiver on
loopback is stopped while a training process exports to it, then started again on the
same port. Export resumes, cumulative series go on from where they were (monotone, same
start time), nothing crashes, and the spans lost while it was down are counted -- in
``training.telemetry.spans.dropped`` as exported after the restart, and in the run-end
summary."""

from __future__ import annotations

import json
import time

import pytest

from tests.otlp_receiver import OTLPReceiver, attributes, data_points
from tests.scripts.harness import Run, instrumented, otel_env

pytestmark = pytest.mark.slow


def _series(metric_lists, name):
    """(start time, value) of the one series of ``name`` in each export, in arrival order."""
    out = []
    for metrics in metric_lists:
        for _, m in metrics:
            if m.name != name:
                continue
            for p in data_points(m):
                value = p.count if m.WhichOneof("data") == "histogram" else (
                    p.as_int if p.WhichOneof("value") == "as_int" else p.as_double)
                out.append((p.start_time_unix_nano, value, tuple(sorted(attributes(p.attributes).items()))))
    return out


def _last(receiver, name, **where):
    value = None
    for _, m in receiver.metrics():
        if m.name == name:
            for p in data_points(m):
                attrs = attributes(p.attributes)
                if all(attrs.get(k) == v for k, v in where.items()):
                    value = p.as_int if p.WhichOneof("value") == "as_int" else p.as_double
    return value


def test_export_resumes_after_a_collector_restart_and_losses_are_counted(tmp_path):
    summary_file = tmp_path / "summary.json"
    stop_file = tmp_path / "stop"
    first = OTLPReceiver().start()
    port = first.port
    env = otel_env(first.endpoint, tmp_path,
                   OTEL_METRIC_EXPORT_INTERVAL="300", OTEL_BSP_SCHEDULE_DELAY="100",
                   # This SDK reads it in seconds: give up on a batch after ~1 s of retries.
                   OTEL_EXPORTER_OTLP_TIMEOUT="1",
                   OTEL_TRAINING_TRACE_EVERY_N="1", OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000",
                   OTEL_TRAINING_HARDWARE="false", OTEL_TRAINING_SUMMARY_FILE=str(summary_file))
    r = Run(instrumented("train_loop.py", "--steps", "0", "--sleep-ms", "10", "--until-file", str(stop_file)),
            env)
    second = None
    try:
        assert first.wait_for(lambda rc: rc.spans() and any(m.name == "training.steps" for _, m in rc.metrics()),
                              timeout=60), r.stderr
        first.stop()  # the Collector goes away mid-run ...
        time.sleep(3.0)  # ... long enough for exports to fail for good (1 s timeout)
        second = OTLPReceiver(port=port).start()  # ... and comes back on the same port
        assert second.wait_for(lambda rc: rc.spans() and any(
            m.name == "training.steps" for _, m in rc.metrics()), timeout=30), r.stderr
        assert second.wait_for(lambda rc: (_last(rc, "training.telemetry.spans.dropped") or 0) > 0,
                               timeout=30), "the drops were not exported after the restart"
        stop_file.touch()
        rc = r.wait(60)
    finally:
        stop_file.touch()
        if r.proc.poll() is None:
            r.proc.kill()
        first.stop()
        if second is not None:
            second.stop()
    assert rc == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    total = int(r.marker("TRAINING_END")[2])

    # Cumulative series continue across the restart: one start time, never decreasing.
    for name in ("training.steps", "training.step.duration"):
        points = _series([first.metrics(), second.metrics()], name)
        assert len({(p[0], p[2]) for p in points}) == 1, f"{name}: a series restarted: {points[:3]}"
        values = [p[1] for p in points]
        assert values == sorted(values), f"{name} went backwards: {values}"
    assert _last(second, "training.steps") == total  # the final export reached the new Collector

    # What was lost while it was down is counted, exported, and in the summary.
    exported_dropped = _last(second, "training.telemetry.spans.dropped")
    assert exported_dropped > 0
    assert _last(second, "training.telemetry.export.failures", **{"training.telemetry.component": "traces"}) > 0
    telemetry = json.loads(summary_file.read_text())["telemetry"]
    assert telemetry["spans_dropped"] >= exported_dropped
    assert telemetry["export_failures"] > 0
    assert len(first.spans()) > 0 and len(second.spans()) > 0
