"""One hardware sampler per host: an advisory, non-blocking ``flock`` on a file in the
temporary directory, named with the uid.

Every rank's sampler tries to take it each tick; the holder samples host and GPU
metrics, the others only their own process's GPU usage. The kernel frees the lock
when the holder exits (however it exits), and the next try by any other rank takes
over, so ranks may start and finish in any order.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import weakref

try:
    import fcntl
except ImportError:  # not POSIX: every process samples (no dedup possible)
    fcntl = None  # type: ignore[assignment]

_logger = logging.getLogger("otel_training.hardware")


def default_lock_path() -> str:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"otel-training-hardware-{uid}.lock")


class HostLock:
    """``try_acquire()`` is cheap (one failed ``flock`` per tick while another holds it)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or default_lock_path()
        self._fd: int | None = None
        self._mutex = threading.Lock()
        self._warned = False
        if hasattr(os, "register_at_fork"):
            # A forked child (a DataLoader worker) shares the open file description,
            # and with it the lock: close its copy so the lock still frees when the
            # holder exits, even while the worker lives on. Held weakly: a fork handler
            # cannot be removed, and it must not keep a lock of an ended run alive.
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        with self._mutex:
            if self._fd is not None:
                return True
            if fcntl is None:
                self._fd = -1
                return True
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    _logger.warning(
                        "hardware lock %s unusable (%s): sampling host metrics in this process", self.path, exc
                    )
                self._fd = -1
                return True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            self._fd = fd
            return True

    def release(self) -> None:
        with self._mutex:
            fd, self._fd = self._fd, None
        if fd is not None and fd >= 0:
            try:
                os.close(fd)  # closing drops the flock
            except OSError:
                pass

    def forget_in_child(self) -> None:
        """In a forked child: close the inherited copy of the lock's file."""
        fd, self._fd = self._fd, None
        self._mutex = threading.Lock()
        if fd is not None and fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def _forget_in_child(ref: weakref.ref) -> None:
    lock = ref()
    if lock is not None:
        lock.forget_in_child()
