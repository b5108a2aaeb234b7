"""The sampler thread: one tick per ``Config.hardware_interval``, independent of exports.

Each tick tries the per-host lock; the holder reads the host and every GPU once, and
every process reads its own GPU usage. The thread is a daemon (it never holds the
interpreter at exit), sleeps on an Event (so shutdown wakes it at once) and never lets
an exception out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from otel_training.hardware.agent_lock import HostLock
from otel_training.hardware.gpu import GpuSource
from otel_training.hardware.host import HostSource
from otel_training.hardware.stats import Store

_logger = logging.getLogger("otel_training.hardware")


class Sampler:
    def __init__(
        self,
        store: Store,
        host_name: str,
        interval: float,
        *,
        lock: HostLock | None = None,
        gpu: bool = True,
        pid: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_gpus: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.interval = interval
        self.host = HostSource(store, host_name)
        self.gpu = GpuSource(store, host_name, pid=pid)
        self.lock = lock if lock is not None else HostLock()
        self.is_host_sampler = False
        self._want_gpu = gpu
        self._set_up = False
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        self._failed_once = False
        self._on_gpus = on_gpus
        self._final_tick = False

    def tick(self, now: float | None = None) -> None:
        """Take one sample of every source this process is responsible for."""
        if not self._set_up:
            self._set_up = True
            # nvmlInit: on this thread, never the caller's
            if self._want_gpu and self.gpu.start() and self._on_gpus is not None:
                self._on_gpus()
        now = self._clock() if now is None else now
        holder = self.lock.try_acquire()
        if holder and not self.is_host_sampler:
            # Counter baselines and NVML cursors from before are stale (or absent).
            self.host.reset()
            self.gpu.reset()
            _logger.info(
                "this process samples host%s metrics for this host (lock %s)",
                " and GPU" if self.gpu.available else "",
                self.lock.path,
            )
        self.is_host_sampler = holder
        if holder:
            self.host.sample(now)
            self.gpu.sample_devices()
        self.gpu.sample_process(now)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="otel-training-hardware", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            deadline = self._clock()
            while not self._stop.is_set():
                try:
                    self.tick()
                except Exception:
                    if not self._failed_once:  # keep sampling; log the first failure only
                        self._failed_once = True
                        _logger.warning("hardware sampling failed", exc_info=True)
                deadline += self.interval
                delay = deadline - self._clock()
                if delay < 0:  # a tick overran: skip the missed ones
                    deadline = self._clock()
                    delay = 0.0
                if self._stop.wait(delay):
                    break
            if self._final_tick:  # the stretch since the last tick, for the last export
                try:
                    self.tick()
                except Exception:
                    pass
        finally:
            self._close()

    def shutdown(self, timeout: float = 1.0, final_tick: bool = False) -> None:
        """Stop the thread, waiting at most ``timeout`` seconds; frees the host lock.
        ``final_tick``: the thread samples once more before it ends."""
        self._final_tick = final_tick
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout))
            if thread.is_alive():
                _logger.info("hardware sampler still busy after %.1f s; leaving it (daemon thread)", timeout)
                self.lock.release()
                return
        self._close()

    def _close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.gpu.close()
        self.lock.release()
