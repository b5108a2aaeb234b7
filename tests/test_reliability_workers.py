"""DataLoader workers and other child processes.

Forked children inherit our hooks and the SDK's state -- and the SDK restarts its
export threads after a fork -- while spawned children (and the forkserver) run
``sitecustomize``, so ``opentelemetry-instrument``, all over again. Either way a worker
must not sample, export, or time anything: no threads of ours or the SDK's, no second
copy of the parent's series (same resource, stale values), no errors."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_training
from otel_training.config import load_config
from otel_training.instrumentor import TrainingInstrumentor
from otel_training.runtime.processes import ROLE_HELPER, ROLE_SPAWN, multiprocessing_role
from tests.otlp_receiver import OTLPReceiver, attributes, data_points
from tests.scripts.harness import instrumented, otel_env, run

EPOCHS = 2
BATCHES = 6


@pytest.mark.parametrize("argv, role", [
    (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
      "--multiprocessing-fork"], ROLE_SPAWN),
    (["-c", "--multiprocessing-fork"], ROLE_SPAWN),  # sys.argv of a spawn child (no orig_argv)
    (["python", "-c", "from multiprocessing.forkserver import main; main(3, 4, ['__main__'], **{})"], ROLE_HELPER),
    (["python", "-c", "from multiprocessing.resource_tracker import main;main(6)"], ROLE_HELPER),
    (["python", "train.py", "--epochs", "2"], None),
    (["python", "-c", "print('multiprocessing.spawn')"], ROLE_SPAWN),  # conservative: mentions it
    (["python", "-m", "torch.distributed.run", "train.py"], None),
])
def test_multiprocessing_roles(argv, role):
    assert multiprocessing_role(argv) == role


class CountingMetricExporter(MetricExporter):
    """Counts exports; a forked child reports its count through a pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
        self.calls += 1
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_forked_child_is_silent_and_hook_free():
    spans = InMemorySpanExporter()
    metrics = CountingMetricExporter()
    tp = TracerProvider()
    bsp = BatchSpanProcessor(spans, schedule_delay_millis=50)
    tp.add_span_processor(bsp)
    reader = PeriodicExportingMetricReader(metrics, export_interval_millis=50)
    mp = MeterProvider(metric_readers=[reader])
    config = dataclasses.replace(load_config({}), trace_every_n=1, trace_max_per_second=1e6, hardware=False,
                                 gpu_timing="off", integrations=())
    inst = TrainingInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=mp, config=config)
    try:
        from otel_training import runtime

        rt = runtime.current()
        model = torch.nn.Linear(4, 2)
        for _ in range(3):
            with otel_training.step():
                model(torch.randn(2, 4)).sum().backward()
        assert rt.pipeline.flush(5)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without running any exit handler
            try:
                exports_before = metrics.calls
                spans_before = len(spans.get_finished_spans())
                with otel_training.step():  # the manual API and hooks are inert here
                    model(torch.randn(2, 4)).sum().backward()
                tp.get_tracer("user").start_span("in-child").end()
                time.sleep(0.5)  # several export intervals
                report = {
                    "current": runtime.current() is not None,
                    "step_open": rt.tracker.step is not None,
                    # Ours, and the export threads of the providers we are attached to
                    # (other tests' leftover providers restart theirs too).
                    "threads": sorted(
                        [t.name for t in threading.enumerate() if t.name.startswith("otel-training")]
                        + [t.name for t in (bsp._batch_processor._worker_thread, reader._daemon_thread)
                           if t.is_alive()]),
                    "metric_exports": metrics.calls - exports_before,
                    "spans_exported": len(spans.get_finished_spans()) - spans_before,
                    "silenced": rt.guard.silenced,
                }
                os.write(write, json.dumps(report).encode())
            finally:
                os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(read) as fh:
            report = json.loads(fh.read())
        assert status == 0
        assert report == {"current": False, "step_open": False, "threads": [], "metric_exports": 0,
                          "spans_exported": 0, "silenced": True}
        # The parent goes on as before.
        assert runtime.current() is rt and not rt.guard.silenced
        before = metrics.calls
        with otel_training.step():
            model(torch.randn(2, 4)).sum().backward()
        time.sleep(0.3)
        assert metrics.calls > before
    finally:
        inst.uninstrument()
        tp.shutdown()
        mp.shutdown()


@pytest.mark.slow
def test_dataloader_workers_with_fork_spawn_and_forkserver(tmp_path):
    """One instrumented process, three loaders: fork (2 workers, re-forked each epoch),
    spawn (1 persistent worker) and forkserver (1 worker)."""
    report = tmp_path / "workers"
    report.mkdir()
    summary_file = tmp_path / "summary.json"
    with OTLPReceiver() as receiver:
        env = otel_env(receiver.endpoint, tmp_path, OTEL_METRIC_EXPORT_INTERVAL="500",
                       OTEL_BSP_SCHEDULE_DELAY="200", OTEL_TRAINING_TRACE_EVERY_N="1",
                       OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000", OTEL_TRAINING_SUMMARY_FILE=str(summary_file))
        r = run(instrumented("train_workers.py", "--start-methods", "fork:2,spawn:1,forkserver:1",
                             "--epochs", str(EPOCHS), "--batches", str(BATCHES), "--report", str(report)),
                env, timeout=240)
        assert r.proc.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        steps = int(r.marker("STEPS")[0])
        parent = int(r.marker("STEPS")[2])
        assert steps == 3 * EPOCHS * BATCHES
        receiver.wait_for(lambda rc: any(m.name == "training.steps" for _, m in rc.metrics()))
        metrics = receiver.metrics()
        traced = receiver.spans()

    # Inside every worker: nothing of ours runs.
    workers = [json.loads(p.read_text()) for p in sorted(report.iterdir())]
    by_method = {}
    for w in workers:
        by_method.setdefault(w["method"], set()).add(w["pid"])
        assert w["threads"] == [], w
        assert not w["otel_training_active"], w
    assert len(by_method["fork"]) == 2 * EPOCHS  # re-forked every epoch
    assert len(by_method["spawn"]) == 1  # persistent across both epochs
    assert len(by_method["forkserver"]) == EPOCHS
    assert all(w["ppid"] == parent for w in workers if w["method"] != "forkserver")

    # Outside: one process's series only, complete and monotone.
    instances = {res.get("service.instance.id") for res, _ in metrics} | {
        res.get("service.instance.id") for res, _ in traced}
    assert len(instances) == 1, f"series from {len(instances)} processes: {instances}"
    counts = [p.as_int for _, m in metrics if m.name == "training.steps" for p in data_points(m)]
    assert counts == sorted(counts) and counts[-1] == steps
    assert len([s for _, s in traced if s.name == "step"]) == steps
    pids = {attributes(p.attributes).get("process.pid") for _, m in metrics for p in data_points(m)} - {None}
    assert pids <= {parent}
    telemetry = json.loads(summary_file.read_text())["telemetry"]
    assert telemetry == {"spans_dropped": 0, "steps_dropped": 0, "export_failures": 0, "errors": 0}


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin-memory threads need an accelerator")
def test_pin_memory_thread_with_workers(tmp_path):
    report = tmp_path / "workers"
    report.mkdir()
    summary_file = tmp_path / "summary.json"
    with OTLPReceiver() as receiver:
        env = otel_env(receiver.endpoint, tmp_path, OTEL_TRAINING_TRACE_EVERY_N="1",
                       OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000", OTEL_TRAINING_SUMMARY_FILE=str(summary_file))
        r = run(instrumented("train_workers.py", "--start-methods", "fork:2,spawn:1", "--pin-memory",
                             "--epochs", str(EPOCHS), "--batches", str(BATCHES), "--report", str(report)),
                env, timeout=240)
        assert r.proc.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        steps = int(r.marker("STEPS")[0])
        receiver.wait_for(lambda rc: len([s for _, s in rc.spans() if s.name == "step"]) >= steps)
        assert len([s for _, s in receiver.spans() if s.name == "step"]) == steps
    for p in report.iterdir():
        w = json.loads(p.read_text())
        assert w["threads"] == [] and not w["otel_training_active"], w
    assert json.loads(summary_file.read_text())["telemetry"]["errors"] == 0


@pytest.mark.slow
def test_a_rank_started_by_torch_multiprocessing_spawn_stays_instrumented(tmp_path):
    """A spawned child that is not a DataLoader worker is a training process: it keeps
    its instrumentation (its own DataLoader worker, spawned in turn, goes silent)."""
    env = otel_env(None, tmp_path, OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                   OTEL_TRAINING_HARDWARE="false",
                   OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "summary-{pid}.json"))
    r = run(instrumented("train_mp_spawn.py"), env, timeout=240)
    assert r.proc.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    rank_pid = int(r.marker("RANK_PID")[0])
    files = sorted(p.name for p in tmp_path.glob("summary-*.json"))
    assert files == [f"summary-{rank_pid}.json"]  # the rank only: no steps, no summary elsewhere
    summary = json.loads((tmp_path / files[0]).read_text())
    assert summary["modes"]["train"]["steps"] == 6
    assert summary["telemetry"]["errors"] == 0


# -- spawned children hold their set-up until the process object arrives --

# What a held child may have loaded of ours: the distro and what it imports, nothing more.
# preflight (the pre-instrument check, standard library only) runs in every process and says
# nothing in a spawned child; package holds the torch floor it reads. The runtime package
# loads its Runtime only when first used.
HELD_MODULES = {"otel_training", "otel_training.distro", "otel_training.runtime", "otel_training.runtime.processes",
                "otel_training.version", "otel_training.preflight", "otel_training.package",
                "otel_training.semconv"}  # (names only: the distro's resource attribute names)


def _assert_set_up_nothing(worker: dict) -> None:
    """A worker that never configured the SDK, loaded an instrumentor or started a thread."""
    assert worker["all_threads"] == ["MainThread"], worker
    assert worker["sdk_loaded"] == [], worker  # the SDK was not even imported
    assert set(worker["otel_training_modules"]) <= HELD_MODULES, worker
    for key, proxy in (("tracer_provider", "ProxyTracerProvider"), ("meter_provider", "_ProxyMeterProvider")):
        if key in worker:
            assert worker[key] in (None, proxy), worker
    assert not worker.get("instrumentor_installed") and not worker.get("otel_training_active"), worker


@pytest.fixture
def held(monkeypatch):
    """``otel_training.runtime.processes`` in a clean state; a test poses as a child through
    ``sys.orig_argv``. The distro's own set-up steps are recorded, not run."""
    from otel_training import distro
    from otel_training.runtime import processes

    processes.reset()
    calls: list = []
    monkeypatch.setattr(distro, "_prepare_process", lambda: calls.append("prepare"))
    monkeypatch.setattr(distro, "apply_defaults", lambda: calls.append("defaults"))

    class FakeSDKConfigurator:
        def configure(self, **kwargs):
            calls.append(("sdk", kwargs))

    monkeypatch.setattr(distro, "_sdk_configurator", lambda: FakeSDKConfigurator)
    yield processes, calls
    processes.reset()


class FakeEntryPoint:
    name = "fake"

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def load(self):
        calls = self.calls

        class Instrumentor:
            def instrument(self, **kwargs):
                calls.append(("instrument", kwargs))

        return Instrumentor


SPAWN_ARGV = [sys.executable, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
              "--multiprocessing-fork"]


def _run_as_opentelemetry_instrument(calls: list):
    """What opentelemetry-instrument's sitecustomize does with our distro and configurator."""
    from otel_training.distro import TrainingConfigurator, TrainingDistro

    distro = TrainingDistro()
    distro.configure()
    TrainingConfigurator().configure(auto_instrumentation_version="0")
    distro.load_instrumentor(FakeEntryPoint(calls), skip_dep_check=True)
    return distro


def test_a_process_that_is_no_child_sets_up_at_once(held, monkeypatch):
    processes, calls = held
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "train.py"], raising=False)
    _run_as_opentelemetry_instrument(calls)
    assert calls == ["prepare", "defaults", ("sdk", {"auto_instrumentation_version": "0"}),
                     ("instrument", {"skip_dep_check": True})]
    assert processes.state() is None


def test_a_spawned_dataloader_worker_drops_what_was_held(held, monkeypatch):
    import multiprocessing
    from multiprocessing import process

    from torch.utils.data._utils.worker import _worker_loop

    processes, calls = held
    original = process.BaseProcess.__dict__["_bootstrap"]
    monkeypatch.setattr(sys, "orig_argv", SPAWN_ARGV, raising=False)
    _run_as_opentelemetry_instrument(calls)
    assert calls == [] and processes.holding()
    assert process.BaseProcess.__dict__["_bootstrap"] is not original  # watching for the process object
    processes.decide(multiprocessing.get_context("spawn").Process(target=_worker_loop))
    assert calls == [] and processes.state() == processes.WORKER and not processes.holding()
    assert process.BaseProcess.__dict__["_bootstrap"] is original  # put back at once


def test_any_other_spawned_process_is_set_up_when_it_arrives(held, monkeypatch):
    import multiprocessing
    from multiprocessing import process

    processes, calls = held
    original = process.BaseProcess.__dict__["_bootstrap"]
    monkeypatch.setattr(sys, "orig_argv", SPAWN_ARGV, raising=False)
    _run_as_opentelemetry_instrument(calls)
    assert calls == []
    processes.decide(multiprocessing.get_context("spawn").Process(target=print))  # e.g. a rank
    assert calls == ["prepare", "defaults", ("sdk", {"auto_instrumentation_version": "0"}),
                     ("instrument", {"skip_dep_check": True})]
    assert processes.released() and not processes.holding()
    assert process.BaseProcess.__dict__["_bootstrap"] is original


def test_a_multiprocessing_helper_holds_for_good(held, monkeypatch):
    import multiprocessing
    from multiprocessing import process

    processes, calls = held
    original = process.BaseProcess.__dict__["_bootstrap"]
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-c", "from multiprocessing.forkserver import main; main(3, 4)"],
                        raising=False)
    _run_as_opentelemetry_instrument(calls)
    assert calls == ["prepare"]  # exporters off for a configurator that is not ours; nothing else
    assert process.BaseProcess.__dict__["_bootstrap"] is original
    processes.decide(multiprocessing.get_context("spawn").Process(target=print))
    assert calls == ["prepare"] and processes.holding()


def test_a_failing_instrumentor_in_a_released_child_is_logged_not_raised(held, monkeypatch, caplog):
    import multiprocessing

    processes, calls = held
    monkeypatch.setattr(sys, "orig_argv", SPAWN_ARGV, raising=False)

    class Broken(FakeEntryPoint):
        def load(self):
            raise RuntimeError("boom")

    from otel_training.distro import TrainingDistro

    distro = TrainingDistro()
    distro.configure()
    distro.load_instrumentor(Broken(calls))
    distro.load_instrumentor(FakeEntryPoint(calls))
    processes.decide(multiprocessing.get_context("spawn").Process(target=print))
    assert calls == ["prepare", "defaults", ("instrument", {})]  # the next one still loaded
    assert "Instrumenting of fake failed" in caplog.text


def test_the_sdk_another_configurator_set_up_is_silenced_in_a_worker(tmp_path):
    """With our distro holding but a configurator that is not ours (two distros, no
    OTEL_PYTHON_CONFIGURATOR), a worker's SDK threads still stop."""
    code = """
import sys, threading
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from otel_training.runtime import processes
from torch.utils.data._utils.worker import _worker_loop
import multiprocessing
sys.orig_argv = sys.orig_argv + ["--multiprocessing-fork"]

class D:
    def configure(self): raise AssertionError("not for a worker")

assert processes.hold(D())
tp = TracerProvider(); tp.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
trace.set_tracer_provider(tp)
metrics.set_meter_provider(MeterProvider(metric_readers=[PeriodicExportingMetricReader(ConsoleMetricExporter(), 60000)]))
assert len(threading.enumerate()) > 1
processes.decide(multiprocessing.get_context("spawn").Process(target=_worker_loop))
print(sorted(t.name for t in threading.enumerate()))
"""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['MainThread']", proc.stdout + proc.stderr


@pytest.mark.slow
def test_spawned_and_forkserver_workers_set_up_nothing(tmp_path):
    """Workers re-created every epoch by spawn and by forkserver neither configure the
    SDK, nor load an instrumentor, nor start a thread (not even to switch it off again);
    the training process still exports every step, alone."""
    report = tmp_path / "workers"
    report.mkdir()
    with OTLPReceiver() as receiver:
        env = otel_env(receiver.endpoint, tmp_path, OTEL_METRIC_EXPORT_INTERVAL="500",
                       OTEL_TRAINING_TRACE_EVERY_N="1", OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000")
        r = run(instrumented("train_workers.py", "--start-methods", "spawn:2,forkserver:2", "--persistent", "",
                             "--epochs", str(EPOCHS), "--batches", str(BATCHES), "--report", str(report)),
                env, timeout=300)
        assert r.proc.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        steps = int(r.marker("STEPS")[0])
        assert receiver.wait_for(lambda rc: len([s for _, s in rc.spans() if s.name == "step"]) >= steps)
        instances = {res.get("service.instance.id") for res, _ in receiver.metrics()} | {
            res.get("service.instance.id") for res, _ in receiver.spans()}
    workers = [json.loads(p.read_text()) for p in sorted(report.iterdir())]
    by_method: dict = {}
    for w in workers:
        by_method.setdefault(w["method"], set()).add(w["pid"])
        _assert_set_up_nothing(w)
    assert {m: len(pids) for m, pids in by_method.items()} == {"spawn": 2 * EPOCHS, "forkserver": 2 * EPOCHS}
    assert len(instances) == 1, instances


@pytest.mark.slow
def test_a_spawned_rank_exports_its_steps_and_its_own_worker_nothing(tmp_path):
    """A ``torch.multiprocessing.spawn`` rank is set up once its process object arrives
    and exports its steps; the DataLoader worker it spawns in turn sets up nothing."""
    report = tmp_path / "workers"
    report.mkdir()
    with OTLPReceiver() as receiver:
        env = otel_env(receiver.endpoint, tmp_path, OTEL_METRIC_EXPORT_INTERVAL="500",
                       OTEL_TRAINING_TRACE_EVERY_N="1", OTEL_TRAINING_TRACE_MAX_PER_SECOND="1000",
                       OTEL_TRAINING_HARDWARE="false")
        r = run(instrumented("train_mp_spawn.py", "--report", str(report)), env, timeout=240)
        assert r.proc.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        rank_pid = int(r.marker("RANK_PID")[0])
        assert receiver.wait_for(lambda rc: len([s for _, s in rc.spans() if s.name == "step"]) >= 6)
        step_spans = [(res, s) for res, s in receiver.spans() if s.name == "step"]
        counts = {}
        for res, m in receiver.metrics():
            if m.name == "training.steps":
                for p in data_points(m):
                    counts[res["service.instance.id"]] = p.as_int
    assert len(step_spans) == 6
    exporters = {res["service.instance.id"] for res, _ in step_spans}
    assert len(exporters) == 1 and set(counts) == exporters and list(counts.values()) == [6]
    (worker,) = [json.loads(p.read_text()) for p in report.iterdir()]
    assert worker["ppid"] == rank_pid
    _assert_set_up_nothing(worker)
