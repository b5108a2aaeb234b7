"""The active instrumentation: config, tracker, hooks, pipeline, hardware.

One Runtime per process, created by the instrumentor; ``current()`` finds it
(the manual API and framework integrations use it).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Any

from otel_training import semconv as sc
from otel_training.aggregate.pipeline import Pipeline
from otel_training.aggregate.run_model import Run
from otel_training.aggregate.sampling import TailCapture
from otel_training.aggregate.summary import RunSummary, SummaryFile
from otel_training.config import Config
from otel_training.export.guard import ExportGuard
from otel_training.export.identity import ProcessInfo, process_info, run_id
from otel_training.export.metrics import StepMetrics
from otel_training.export.sdk import export_interval_s
from otel_training.export.selftelemetry import SelfTelemetry
from otel_training.export.spans import StepSpans
from otel_training.handles import Handles
from otel_training.record.step_assembly import StepAssembler
from otel_training.record.tracker import Tracker
from otel_training.runtime import processes
from otel_training.runtime.attempts import attempt_file
from otel_training.runtime.goodput import Goodput
from otel_training.runtime.measures import StepMeasures
from otel_training.runtime.process_events import ProcessEvents, hook_main_thread_end
from otel_training.runtime.processes import ROLE_HELPER, ROLE_SPAWN, multiprocessing_role
from otel_training.runtime.rank import RankWatch, say_missing
from otel_training.runtime.run_end import run_model
from otel_training.runtime.shutdown import run_steps, shutdown_steps
from otel_training.version import __version__

logger = logging.getLogger("otel_training")
_CURRENT: Runtime | None = None


def current() -> Runtime | None:
    return _CURRENT


def _main_thread_ended() -> None:
    runtime = _CURRENT
    if runtime is not None:
        runtime._main_thread_ended()


def _service_name(tracer_provider) -> str:
    resource = getattr(tracer_provider, "resource", None)
    if resource is not None:
        name = resource.attributes.get("service.name")
        if name:
            return str(name)
    return os.environ.get("OTEL_SERVICE_NAME", "unknown_service")


class Runtime(ProcessEvents):
    def __init__(self, config: Config, tracer_provider, meter_provider) -> None:
        from otel_training.timing import make_timer

        self.config = config
        self.telemetry = SelfTelemetry()
        self.role = multiprocessing_role()
        self._spawned = self.role == ROLE_SPAWN  # the launcher's variables it inherited name its parent
        self.info = process_info(spawned=self._spawned)  # replaced once the rank is known (rank.py)
        self.timer = make_timer(config.gpu_timing)
        tracer = tracer_provider.get_tracer(sc.SCOPE, __version__)
        meter = meter_provider.get_meter(sc.SCOPE, __version__)
        common = self.info.metric_attributes()
        self._meter = meter
        self._common = common
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        summary_info = {
            "service": _service_name(tracer_provider),
            "run_id": run_id(),
            "host": self.info.host_name,
            "rank": self.info.rank,
            "world_size": self.info.world_size,
            "pid": os.getpid(),
        }
        offset = time.time_ns() - time.perf_counter_ns()  # perf_counter ns -> epoch ns, fixed once
        self.trace_file = self._trace_file(config, summary_info, offset)
        self.measures = StepMeasures(config, meter, common, self.on_error)  # throughput, FLOPs, memory
        rank = self.info.rank  # no attempt file without a rank to name it
        attempts = None if rank is None else attempt_file(config.attempts_dir, run_id(), rank, os.environ)
        self.goodput = Goodput(self.on_error, attempts)  # the process's wall time by activity (goodput.py)
        # Profiles armed by the run (OTEL_TRAINING_PROFILE): off, nothing of it exists.
        self.profiling = self._profiling(config)
        triggers = self.profiling.triggers if self.profiling is not None else None
        self._spans = StepSpans(tracer, common, offset, (lambda: triggers.marked) if triggers is not None else None)
        self._metrics = StepMetrics(
            meter,
            common,
            meter_provider,
            __version__,
            lambda exc: self.telemetry.internal_error("metrics", exc),
            offset,
        )
        self.pipeline = Pipeline(
            spans=self._spans,
            metrics=self._metrics,
            capture=TailCapture(config.trace_slow_factor, config.trace_every_n, config.trace_max_per_second),
            summary=RunSummary(summary_info, self.timer.mode),
            timer=self.timer,
            telemetry=self.telemetry,
            offset=offset,
            trace_file=self.trace_file,
            timeseries=bool(config.summary or config.summary_file),
            consumers=(*self.measures.consumers, self.goodput.clock, *((triggers,) if triggers is not None else ())),
            export_interval_s=export_interval_s(meter_provider),
            profiles=self.profiling.capture if self.profiling is not None else None,
        )
        self._started_ns = time.perf_counter_ns()
        # The recorder's wiring, all of it here: pieces -> assembler -> (FLOP probe) -> pipeline.
        assembler = StepAssembler(
            self.pipeline.submit,
            config.step_boundary,
            release=self.timer.release,
            between_sink=self.pipeline.submit_between,  # named time between steps
            probe=self.measures.make_probe(self.pipeline.submit, lambda: self.module_hooks),
        )
        self.tracker = Tracker(assembler, self.timer, memory=self.measures.reader)
        self.measures.attach(assembler, self.tracker)
        self.module_hooks: Any = None  # RootModuleHooks, once installed
        self.handles = Handles()  # every attachment; uninstall removes them in reverse
        self.hardware: Any = None  # HardwareMetrics, when sampling
        self.guard: ExportGuard | None = None
        self.active = False
        if self.role == ROLE_SPAWN and processes.released():
            # Set up by the distro once the process object arrived: no DataLoader worker.
            self.role = None
        self._closed = False
        self._lock = threading.RLock()  # re-entrant: SIGTERM may arrive during shutdown
        self.summary_file = SummaryFile(config.summary_file, self.info.rank)

    def _profiling(self, config: Config) -> Any:
        if not config.profile or self.role == ROLE_HELPER:
            return None
        from otel_training.runtime.profiling import Profiling

        return Profiling(
            config,
            lambda: (run_id(), self.info.rank),
            lambda: self.info.world_size,
            lambda: self.goodput.clock.recompilations,
            self.on_error,
        )

    def _trace_file(self, config: Config, info: dict, offset: int) -> Any:
        if not config.trace_file:
            return None
        from otel_training.export.trace_file import TraceFile

        # The tracker is made after the pipeline: read its training thread when needed.
        return TraceFile(config.trace_file, offset, info, lambda: self.tracker.thread)

    # -- wiring -------------------------------------------------------------------------
    def on_error(self, component: str, exc: BaseException, *, said: bool = False) -> None:
        self.telemetry.internal_error(component, exc, said=said)

    def install(self) -> None:
        if self.role == ROLE_HELPER:
            # The forkserver or the resource tracker: nothing to time, nothing to export.
            self._closed = True
            return
        from otel_training.record.module_hooks import RootModuleHooks
        from otel_training.record.torch_hooks import TorchHooks

        handles = self.handles
        tracker = self.tracker
        self.module_hooks = handles.add(RootModuleHooks(tracker, self.on_error))
        self.module_hooks.arm()
        tracker.phases.call_after_steps(self.module_hooks.on_step_end)  # re-arms discovery when needed
        # A new loop often brings a new model (a checkpoint loaded for evaluation, an
        # EMA copy): discovery watches its first step, so its first forward is seen.
        tracker.on_loop = self.module_hooks.arm
        handles.on_remove(self._unhook_tracker, "tracker callbacks")
        handles.add(TorchHooks(tracker, self.on_error).install())
        if self.role != ROLE_SPAWN:  # (a spawned DataLoader worker never counts FLOPs)
            try:
                self.measures.prepare()
            except Exception as exc:
                self.on_error("flops", exc)
        self.goodput.install(tracker, handles, self._meter, self._common)
        self.pipeline.start()
        try:
            self.guard = handles.add(ExportGuard(self.telemetry).attach(self.tracer_provider, self.meter_provider))
            self.telemetry.register(self._meter, self._common)
        except Exception as exc:
            self.on_error("export_guard", exc)
        try:
            from otel_training.export import progress

            progress.register(self._meter, self.tracker, self._common, self.on_error)
        except Exception as exc:
            self.on_error("progress", exc)
        if self.config.hardware:
            try:
                from otel_training.hardware import start_hardware_metrics

                self.hardware = start_hardware_metrics(self.meter_provider, self.config, host_name=self.info.host_name)
            except Exception as exc:
                self.on_error("hardware", exc)
        global _CURRENT
        _CURRENT = self
        self.active = True
        atexit.register(self.shutdown)
        handles.on_remove(lambda: atexit.unregister(self.shutdown), "atexit")
        hook_main_thread_end(_main_thread_ended)
        self._install_process_handlers()
        watch = RankWatch(self._use_identity, self.on_error, spawned=self._spawned)
        arm = self.module_hooks.arm

        def on_loop() -> None:
            # Until the first step is handed on, a loop start also looks for a group
            # made through a path not wrapped; then the plain callback again.
            if tracker.assembler.steps or watch.settled:
                tracker.on_loop = arm
            else:
                watch.check()
            arm()

        tracker.on_loop = on_loop
        watch.install(handles)
        if self.role != ROLE_SPAWN:  # a spawned child checks once it knows it is no worker
            say_missing(self.info)
            self._check_files()
            if self.profiling is not None:
                self.profiling.start()

    def _use_identity(self, info: ProcessInfo) -> None:
        """Export under ``info`` (the process group's rank) from now on; the summary and
        the files it names take it too."""
        same = info.metric_attributes() == self.info.metric_attributes() and info.rank == self.info.rank
        self.info = info
        if same:  # (the launcher's variables were right)
            return
        self._common = common = info.metric_attributes()
        self._spans.rebind(common)
        self._metrics.rebind(common)
        self.measures.rebind(common)
        self.goodput.rebind(self._meter, common)
        self.telemetry.register(self._meter, common)
        from otel_training.export import progress

        progress.register(self._meter, self.tracker, common, self.on_error)
        ranks = {"rank": info.rank, "world_size": info.world_size}
        self.pipeline.summary.info.update(ranks)
        if self.trace_file is not None:
            self.trace_file.info.update(ranks)
        self.summary_file.rank = info.rank
        say_missing(info)

    def _check_files(self) -> None:
        self.summary_file.check()
        if self.trace_file is not None:
            self.trace_file.check()

    def disable_in_child(self, why: str) -> None:
        """This process is a forked child or a DataLoader worker: no hooks fire, no
        summary is printed, no export leaves it, and our threads and the SDK's stop."""
        forked = why == "fork"
        if forked:  # a lock some parent thread held at the fork stays held here forever
            self._lock = threading.RLock()
            self.telemetry.after_fork()
        with self._lock:
            self._closed = True
        self.active = False
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None
        self.tracker.disable()
        self.goodput.abandon()  # the parent keeps the attempt's record
        if self.profiling is not None:
            self.profiling.abandon()
        self.pipeline.abandon(wake=not forked)  # a spawned worker started its own pipeline thread
        if self.guard is not None:
            self.guard.silence(join_timeout=0.0 if forked else 0.5)
        if self.hardware is not None and not forked:
            # A spawned worker started its own sampler; a forked one has no thread (and
            # must not shut down NVML or the lock file it inherited).
            try:
                self.hardware.shutdown(0.5)
            except Exception as exc:
                self.on_error("hardware", exc)

    def uninstall(self) -> None:
        """Remove every attachment, the last made first (exact restore); telemetry so
        far is flushed."""
        self.shutdown(final=False)
        self.handles.remove(lambda exc: self.on_error("uninstall", exc))
        self.active = False
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None

    def _unhook_tracker(self) -> None:
        # A later manual step() must not re-arm discovery.
        self.tracker.phases.call_after_steps(None)
        self.tracker.on_loop = None

    # -- end of run -------------------------------------------------------------------------
    def flush(self, timeout: float) -> bool:
        """Turn finished steps into telemetry and export it, within ``timeout`` seconds;
        the run goes on. True if everything went out."""
        deadline = time.monotonic() + timeout
        done = self.pipeline.flush(timeout * 0.5)
        guard = self.guard
        if guard is not None and not guard.silenced:
            done = guard.flush(max(0.0, deadline - time.monotonic())) and done
        return done

    def summary_dict(self) -> dict:
        """The run summary as the file's dict."""
        return self.run_model().to_dict()

    def run_model(self) -> Run:
        """The run summary: each part's section, now."""
        return run_model(self)

    def shutdown(self, final: bool = True) -> None:
        """End the open step, flush everything within ``OTEL_TRAINING_SHUTDOWN_TIMEOUT``,
        print/write the summary.

        ``final`` (at exit, on SIGTERM) also shuts the tracer and meter providers down
        within the same budget, so the SDK's own exit handlers have nothing left to wait
        for; ``uninstall()`` passes ``final=False`` and leaves the providers running.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        started = time.monotonic()
        budget = self.config.shutdown_timeout
        deadline = started + budget

        def left(share: float = 1.0) -> float:
            return max(0.0, (deadline - time.monotonic()) * share)

        run_steps(shutdown_steps(self, final, left), self.on_error)

    def report(self) -> None:
        """The run-end table on stderr, the summary file and the trace file."""
        try:
            from otel_training.diagnosis.findings_text import self_check_line
            from otel_training.diagnosis.summary_text import render_summary

            summary = self.run_model()
            if self.config.summary and summary.modes:
                print(render_summary(summary), file=sys.stderr, flush=True)
            else:  # the self-check speaks without being asked
                for finding in summary.self_check or ():
                    print(self_check_line(finding), file=sys.stderr, flush=True)
            # A process that timed no step (an instrumented torchrun launcher) has no
            # summary to give -- and without RANK it would overwrite rank 0's file.
            if summary.modes:
                self.summary_file.write(summary)
        except Exception as exc:
            self.on_error("summary", exc)
        if self.trace_file is not None:
            try:
                self.trace_file.write()
            except Exception as exc:
                self.on_error("trace_file", exc)
