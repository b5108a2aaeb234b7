"""The active instrumentation: config, tracker, hooks, pipeline, hardware.

One Runtime per process, created by the instrumentor; ``current()`` finds it
(the manual API and framework integrations use it).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any

from otel_training import processes
from otel_training import semconv as sc
from otel_training.aggregate.pipeline import Pipeline
from otel_training.aggregate.sampling import TailCapture
from otel_training.aggregate.summary import RunSummary, SummaryFile
from otel_training.config import Config
from otel_training.export.guard import ExportGuard
from otel_training.export.identity import process_info, run_id
from otel_training.export.metrics import StepMetrics
from otel_training.export.sdk import export_interval_s
from otel_training.export.selftelemetry import SelfTelemetry
from otel_training.export.spans import StepSpans
from otel_training.goodput import Goodput
from otel_training.handles import Handles
from otel_training.perf import Perf
from otel_training.processes import ROLE_HELPER, ROLE_SPAWN, multiprocessing_role
from otel_training.record.reentry import interrupted_bookkeeping
from otel_training.record.step_assembly import StepAssembler
from otel_training.record.tracker import Tracker
from otel_training.version import __version__

logger = logging.getLogger("otel_training")
_SIGTERM_RETRIES = 100  # deliveries 1 ms apart while SIGTERM lands in our own code (record/reentry.py)
_CURRENT: Runtime | None = None


def _after_fork_in_child(ref) -> None:
    runtime = ref()
    if runtime is not None and runtime.active:  # installed, not uninstalled
        runtime.disable_in_child("fork")


def _ending_exception(final: bool) -> BaseException | None:
    """The exception that is ending the run, if any: the one being handled, or -- at
    interpreter exit, not in an interactive session -- the uncaught one Python
    reported (``sys.last_value``), e.g. from an optimizer step, which no hook wraps."""
    exc = sys.exc_info()[1]
    if exc is None and final and not hasattr(sys, "ps1") and not sys.flags.interactive:
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return None if isinstance(exc, SystemExit) else exc


_MAIN_IDENT = threading.main_thread().ident
_main_end_hooked = False


def _hook_main_thread_end() -> None:
    """Once per process: when the main thread's code has returned, the current runtime
    hears of it (threading's own exit hook, which ``concurrent.futures`` uses too, runs
    before any ``atexit`` handler). Where this Python lacks it, the ``atexit`` handler
    ends the open step, as before."""
    global _main_end_hooked
    register = getattr(threading, "_register_atexit", None)
    if _main_end_hooked or register is None:
        return
    try:
        register(_main_thread_ended)
        _main_end_hooked = True
    except RuntimeError:  # the interpreter is already shutting down
        pass


def _main_thread_ended() -> None:
    runtime = _CURRENT
    if runtime is not None:
        runtime._main_thread_ended()


def current() -> Runtime | None:
    return _CURRENT


def _service_name(tracer_provider) -> str:
    resource = getattr(tracer_provider, "resource", None)
    if resource is not None:
        name = resource.attributes.get("service.name")
        if name:
            return str(name)
    return os.environ.get("OTEL_SERVICE_NAME", "unknown_service")


class Runtime:
    def __init__(self, config: Config, tracer_provider, meter_provider) -> None:
        from otel_training.timing import make_timer

        self.config = config
        self.telemetry = SelfTelemetry()
        self.info = process_info()
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
        self.perf = Perf(config, meter, common, self.on_error)  # throughput, FLOPs, memory (perf.py)
        self.goodput = Goodput(self.on_error)  # the process's wall time by activity (goodput.py)
        self.pipeline = Pipeline(
            spans=StepSpans(tracer, common, offset, self.telemetry),
            metrics=StepMetrics(
                meter,
                common,
                meter_provider,
                __version__,
                lambda exc: self.telemetry.internal_error("metrics", exc),
                offset,
            ),
            capture=TailCapture(config.trace_slow_factor, config.trace_every_n, config.trace_max_per_second),
            summary=RunSummary(summary_info, self.timer.mode),
            timer=self.timer,
            telemetry=self.telemetry,
            offset=offset,
            trace_file=self.trace_file,
            timeseries=bool(config.summary or config.summary_file),
            consumers=(*self.perf.consumers, self.goodput.clock),
            export_interval_s=export_interval_s(meter_provider),
        )
        self._started_ns = time.perf_counter_ns()
        assembler = StepAssembler(self.pipeline.submit, config.step_boundary, release=self.timer.release)
        assembler.between_sink = self.pipeline.submit_between  # named time between steps
        self.tracker = Tracker(assembler, self.timer)
        self.perf.attach(assembler, self.pipeline.submit, self.tracker, lambda: self.module_hooks)
        self.module_hooks: Any = None  # RootModuleHooks, once installed
        self.handles = Handles()  # every attachment; uninstall removes them in reverse
        self.hardware: Any = None  # HardwareMetrics, when sampling
        self.guard: ExportGuard | None = None
        self.active = False
        self.role = multiprocessing_role()
        if self.role == ROLE_SPAWN and processes.released():
            # Set up by the distro once the process object arrived: no DataLoader worker.
            self.role = None
        self._closed = False
        self._lock = threading.RLock()  # re-entrant: SIGTERM may arrive during shutdown
        self.summary_file = SummaryFile(config.summary_file, self.info.rank)

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
        from otel_training.record.torch_hooks import install_torch_hooks

        handles = self.handles
        tracker = self.tracker
        self.module_hooks = handles.add(RootModuleHooks(tracker, self.on_error))
        self.module_hooks.arm()
        tracker.after_step = self.module_hooks.on_step_end  # re-arms discovery when needed
        # A new loop often brings a new model (a checkpoint loaded for evaluation, an
        # EMA copy): discovery watches its first step, so its first forward is seen.
        tracker.on_loop = self.module_hooks.arm
        handles.on_remove(self._unhook_tracker, "tracker callbacks")
        install_torch_hooks(tracker, handles, self.on_error)
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
        _hook_main_thread_end()
        self._install_process_handlers()
        if self.role != ROLE_SPAWN:  # a spawned child checks once it knows it is no worker
            self._check_files()

    def _install_process_handlers(self) -> None:
        """Fork, spawn and SIGTERM: workers stay silent, a terminated job still flushes."""
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _after_fork_in_child(ref))
        if self.role == ROLE_SPAWN:
            # A spawned child ran sitecustomize like its parent; only once the process
            # object arrives do we learn whether it is a DataLoader worker.
            try:
                import multiprocessing.process as mp_process

                self.handles.wrap(mp_process.BaseProcess, "run", self._process_run_wrapper)
            except Exception as exc:
                self.on_error("workers", exc)
        try:
            if (
                threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
            ):
                self._sigterm_retries = 0
                signal.signal(signal.SIGTERM, self._on_sigterm)
                self.handles.on_remove(self._restore_sigterm, "SIGTERM")
        except (ValueError, OSError, AttributeError) as exc:  # not the main interpreter
            self.on_error("signals", exc)

    def _check_files(self) -> None:
        self.summary_file.check()
        if self.trace_file is not None:
            self.trace_file.check()

    def _process_run_wrapper(self, wrapped, instance, args, kwargs):
        # Under opentelemetry-instrument the distro holds a spawned child's set-up until
        # the process object arrives (otel_training.processes), so a worker never gets
        # here; this covers instrument() called in a spawned child's own code.
        if processes.is_dataloader_worker(instance):
            try:
                self.disable_in_child("dataloader worker")
            except Exception as exc:  # pragma: no cover
                self.on_error("workers", exc)
        elif not self._closed:
            self._check_files()  # e.g. a rank started by torch.multiprocessing.spawn
        return wrapped(*args, **kwargs)

    def _on_sigterm(self, signum, frame) -> None:
        """Flush within the shutdown budget, then die of SIGTERM as if we were not here.

        Called by another handler that took our place and chains to us (PyTorch
        Lightning does, to stop at the next step and save state): flush only, and leave
        the decision to it -- the exit handlers finish the job later. Landed inside our
        own bookkeeping, it comes again 1 ms later (record/reentry.py)."""
        if signal.getsignal(signal.SIGTERM) != self._on_sigterm:
            try:
                self.flush(self.config.shutdown_timeout)
            except Exception:  # pragma: no cover
                pass
            return
        try:
            if self._sigterm_retries < _SIGTERM_RETRIES and interrupted_bookkeeping(frame):
                # Mid-step in our own code: ending the run from here would lose that step.
                self._sigterm_retries += 1
                again = (threading.main_thread().ident, signal.SIGTERM)
                timer = threading.Timer(0.001, signal.pthread_kill, again)
                timer.daemon = True
                timer.start()
                return
        except Exception:  # pragma: no cover - end the run now, as before
            pass
        try:
            self.shutdown(final=True)
        except Exception:  # pragma: no cover - never stand between a job and its exit
            pass
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except Exception:  # pragma: no cover
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    def _main_thread_ended(self) -> None:
        """The main thread's code returned (interpreter exit, before the ``atexit``
        handlers and the joins of other threads): a step still open on it ends now.
        Else a loop that ends without a loader's ``StopIteration`` (nanoGPT's
        ``while True: ... break``) would hold in its last step the exit-time work of
        libraries whose handlers run before ours (``torch.compile``'s worker pool: 1-1.5 s
        on an H100 machine). Training on a non-daemon thread is joined first, as the
        interpreter would join it next, and its open step ends when it has ended (a
        thread that has not trained yet is unknown here: its last step ends at exit)."""
        try:
            tracker = self.tracker
            if not self.active or self._closed:
                return
            ident = tracker.thread
            if ident is None:
                return
            if ident != _MAIN_IDENT:
                thread = next((t for t in threading.enumerate() if t.ident == ident), None)
                if thread is not None:
                    if thread.daemon:  # never joined: the atexit handler ends its step
                        return
                    thread.join()
            self.goodput.end()
            if tracker.step is not None:
                tracker.finish_step(_ending_exception(True))
        except Exception as exc:
            self.on_error("shutdown", exc)

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
        self.tracker.after_step = None
        self.tracker.on_loop = None

    def _restore_sigterm(self) -> None:
        try:
            if (
                threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == self._on_sigterm
            ):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError):  # pragma: no cover
            pass

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
        summary = self.pipeline.summary.to_dict(self.telemetry.as_dict())
        coverage = self.pipeline.coverage
        summary["step_boundary"] = self.config.step_boundary
        summary["loaders"] = sorted(self.tracker.loaders)  # which advice fits a data-bound run
        summary["coverage"] = coverage.to_dict(self._started_ns)
        summary["self_check"] = self.goodput.self_check(coverage, self.tracker)
        self.perf.summarize(summary)
        self.goodput.summarize(summary, self.pipeline.summary)
        if self.pipeline.timeseries is not None:
            summary["timeseries"] = self.pipeline.timeseries.to_dict()
        return summary

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

        self.goodput.end()
        try:
            if self.tracker.step is not None:
                self.tracker.finish_step(_ending_exception(final))
        except Exception as exc:
            self.on_error("shutdown", exc)
        try:
            self.tracker.close()  # steps the assembler still holds
            self.perf.close()  # a FLOP count still open (the run ended inside it)
        except Exception as exc:
            self.on_error("shutdown", exc)
        try:
            self.pipeline.stop(left(0.4))
            try:
                self.timer.close()
            except Exception as exc:
                self.on_error("device_timing", exc)
        except Exception as exc:
            self.on_error("shutdown", exc)
        self.goodput.finish()  # before the last export: it carries the shut-down time
        if self.hardware is not None:
            try:
                self.hardware.stop_sampling(min(1.0, left(0.25)))
            except Exception as exc:
                self.on_error("hardware", exc)
        guard = self.guard
        if guard is not None and not guard.silenced:
            try:
                # Leave a quarter of the budget for giving up cleanly and shutting down.
                # The hardware gauges still report here: this last export carries the
                # samples since the one before (all of them, in a run shorter than the
                # export interval), the sampler's last one included.
                if not guard.flush(left(0.75)) and final:
                    guard.abort()  # interrupts the exporters' retry backoff
                    guard.flush(min(0.2, left(0.3)))  # lets the aborted exports count
                    self.telemetry.drop_spans(guard.discard_pending())
            except Exception as exc:
                self.on_error("shutdown", exc)
        if self.hardware is not None:
            try:
                self.hardware.shutdown(0.0)  # stopped above; the gauges report nothing from now
            except Exception as exc:
                self.on_error("hardware", exc)
        self._report()
        if final and guard is not None and not guard.silenced:
            try:
                guard.shutdown_providers(max(0.05, left()))
            except Exception as exc:
                self.on_error("shutdown", exc)

    def _report(self) -> None:
        try:
            from otel_training.cli.render import render_summary, self_check_line

            summary = self.summary_dict()
            if self.config.summary and summary["modes"]:
                print(render_summary(summary), file=sys.stderr, flush=True)
            else:  # the self-check speaks without being asked
                for finding in summary["self_check"]:
                    print(self_check_line(finding), file=sys.stderr, flush=True)
            # A process that timed no step (an instrumented torchrun launcher) has no
            # summary to give -- and without RANK it would overwrite rank 0's file.
            if summary["modes"]:
                self.summary_file.write(summary)
        except Exception as exc:
            self.on_error("summary", exc)
        if self.trace_file is not None:
            try:
                self.trace_file.write()
            except Exception as exc:
                self.on_error("trace_file", exc)
