"""Process events of the runtime: fork, spawn, SIGTERM and the main thread's end.

A forked child or a DataLoader worker goes silent; a terminated job still flushes;
a step still open when the main thread's code returns ends then. ``ProcessEvents``
is a part of ``Runtime`` (runtime/active.py), which provides the attributes and
methods declared on it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from otel_training.config import Config
from otel_training.handles import Handles
from otel_training.record.reentry import interrupted_bookkeeping
from otel_training.runtime import processes

_SIGTERM_RETRIES = 100  # deliveries 1 ms apart while SIGTERM lands in our own code (record/reentry.py)


def after_fork_in_child(ref) -> None:
    runtime = ref()
    if runtime is not None and runtime.active:  # installed, not uninstalled
        runtime.disable_in_child("fork")


def ending_exception(final: bool) -> BaseException | None:
    """The exception that is ending the run, if any: the one being handled, or -- at
    interpreter exit, not in an interactive session -- the uncaught one Python
    reported (``sys.last_value``), e.g. from an optimizer step, which no hook wraps."""
    exc = sys.exc_info()[1]
    if exc is None and final and not hasattr(sys, "ps1") and not sys.flags.interactive:
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return None if isinstance(exc, SystemExit) else exc


_MAIN_IDENT = threading.main_thread().ident
_main_end_hooked = False


def hook_main_thread_end(callback: Callable[[], None]) -> None:
    """Once per process: when the main thread's code has returned, ``callback`` runs
    (it tells the current runtime) (threading's own exit hook, which ``concurrent.futures`` uses too, runs
    before any ``atexit`` handler). Where this Python lacks it, the ``atexit`` handler
    ends the open step, as before."""
    global _main_end_hooked
    register = getattr(threading, "_register_atexit", None)
    if _main_end_hooked or register is None:
        return
    try:
        register(callback)
        _main_end_hooked = True
    except RuntimeError:  # the interpreter is already shutting down
        pass


class ProcessEvents:
    """Fork, spawn, SIGTERM and main-thread-end handling, mixed into ``Runtime``."""

    # Provided by Runtime.
    config: Config
    tracker: Any
    goodput: Any  # runtime/goodput.py's Goodput
    handles: Handles
    role: str | None
    active: bool
    _closed: bool
    _sigterm_retries: int
    on_error: Callable[..., None]
    flush: Callable[[float], bool]
    shutdown: Callable[..., None]
    disable_in_child: Callable[[str], None]
    _check_files: Callable[[], None]

    def _install_process_handlers(self) -> None:
        """Fork, spawn and SIGTERM: workers stay silent, a terminated job still flushes."""
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: after_fork_in_child(ref))
        if self.role == processes.ROLE_SPAWN:
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

    def _process_run_wrapper(self, wrapped, instance, args, kwargs):
        # Under opentelemetry-instrument the distro holds a spawned child's set-up until
        # the process object arrives (otel_training.runtime.processes), so a worker never gets
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
                tracker.finish_step(ending_exception(True))
        except Exception as exc:
            self.on_error("shutdown", exc)

    def _restore_sigterm(self) -> None:
        try:
            if (
                threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == self._on_sigterm
            ):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError):  # pragma: no cover
            pass
