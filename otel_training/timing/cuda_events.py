"""``events`` mode: CUDA events recorded at phase boundaries, read off the training thread.

Training thread (``mark``): take a pre-created timing event from a bounded pool and
record it on the current stream -- a few microseconds, no allocation, never a wait.
If the pool is empty (the pipeline lags), the mark gets no event.

Pipeline thread (``resolve``): wait for the step's events (``Event.synchronize``
releases the GIL; the events use blocking sync, so the wait sleeps instead of
spinning a core) and convert each to the host clock. CUDA only gives event-to-event
intervals (``elapsed_time``), so the conversion needs an *anchor*: an event recorded
on an idle side stream right after a host timestamp ``t0``. The GPU cannot process a
record before it was submitted, so every ``(t0, event)`` pair gives a lower bound of
the host-minus-device clock offset; anchors (every ``anchor_interval_s``) and the
step's own events (tight when their stream was idle) all feed one estimator that
keeps the tightest bound, widened by the allowed clock drift for older samples. A
device time is then ``elapsed(reference, event) + offset``: never later than the
truth, earlier by a few microseconds (the record call's own latency).

torch is imported lazily; ``backend`` swaps torch.cuda for a simulated device in tests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from otel_training.timing.cuda_backend import CudaBackend, torch_backend
from otel_training.timing.device import DeviceTimer, DeviceTimes

logger = logging.getLogger("otel_training")


def _not_capturing() -> bool:
    return False


class _Mark:
    """A token: the event recorded at a boundary, then (once resolved) its time."""

    __slots__ = ("event", "t0", "seq", "ns")

    def __init__(self, event: Any, t0: int, seq: int):
        self.event = event  # None once resolved or given back
        self.t0 = t0  # host time just before the record call
        self.seq = seq
        self.ns: int | None = None


class OffsetEstimator:
    """Host-minus-device clock offset from lower-bound samples (pure arithmetic).

    A sample ``(t, s)`` says: at host time ``t`` the offset was at least ``s``. With
    clock drift at most ``drift`` (fraction), it was at least ``s - drift*|t'-t|`` at
    ``t'``; the estimate is the tightest such bound. Offsets are relative to the
    current reference event; ``rebase`` moves them to a new one.
    """

    def __init__(self, drift: float = 20e-6, max_samples: int = 64):
        self.drift = drift
        self._samples: deque = deque(maxlen=max_samples)

    def add(self, t: int, s: int) -> None:
        self._samples.append((t, s))

    def rebase(self, shift: int) -> None:
        """The reference moved ``shift`` ns later on the device clock."""
        self._samples = deque(((t, s + shift) for t, s in self._samples), maxlen=self._samples.maxlen)

    def offset(self, at: int) -> int | None:
        drift = self.drift
        best = None
        for t, s in self._samples:
            v = s - drift * abs(at - t)
            if best is None or v > best:
                best = v
        return None if best is None else int(best)

    def __len__(self) -> int:
        return len(self._samples)


class CudaEventTimer(DeviceTimer):
    """Mode ``events``: pooled CUDA timing events, resolved on the pipeline thread.

    ``mode`` reads ``off`` until the program initializes CUDA (then ``events``).
    """

    def __init__(
        self,
        capacity: int = 2048,
        anchor_interval_s: float = 1.0,
        drift_ppm: float = 20.0,
        backend: CudaBackend | None = None,
    ):
        self._backend = backend
        self._capturing: Callable[[], bool] = _not_capturing  # the backend's, once active
        self._capacity = max(2, int(capacity))
        self._interval_ns = int(anchor_interval_s * 1e9)
        self._clock = backend.clock if backend is not None else time.perf_counter_ns
        self._free: deque = deque()  # append/pop are atomic: no lock on the hot path
        self._outstanding: deque = deque()  # tokens handed out, oldest first
        self._lock = threading.Lock()  # token claims (resolve vs release)
        self._estimator = OffsetEstimator(drift_ppm * 1e-6)
        self._active = False
        self._disabled = False
        self._closed = False
        self._seq = 0
        self._side: Any = None
        self._ref: Any = None  # the reference anchor event: device times are relative to it
        self._ref_t0 = 0
        self._spare: Any = None
        self._warned = False

    @property
    def mode(self) -> str:
        return "events" if self._active else "off"

    @property
    def observes_device(self) -> bool:
        return self._active

    # -- training thread ----------------------------------------------------------------
    def _activate(self) -> bool:
        backend = self._backend
        if backend is None:
            found = torch_backend()
            if found is None:
                return False  # torch not imported yet
            if found is False:
                self._disabled = True
                return False  # auto on a machine without CUDA: host clocks, silently
            backend = self._backend = found
            self._clock = backend.clock
        if not backend.ready():
            return False  # CUDA not initialized yet: the model is not on the GPU
        try:
            device = backend.current_device()
            side = backend.new_stream(device)
            events = [backend.new_event() for _ in range(self._capacity)]
            for ev in events:  # creates each CUDA event now, not on the hot path
                ev.record(side)
            self._ref, self._spare = None, backend.new_event()
            self._spare.record(side)
        except Exception as exc:
            self._disabled = True
            logger.warning("otel-training: CUDA events unavailable (%r); using host clocks", exc)
            return False
        self._side = side
        self._capturing = backend.capturing
        self._free.extend(events)
        self._active = True
        return True

    def activate(self) -> bool:
        return self._active or (not self._disabled and not self._closed and self._activate())

    def mark(self) -> Any:
        if not self._active:
            if self._disabled or self._closed or not self._activate():
                return None
        try:
            ev = self._free.pop()
        except IndexError:  # the pipeline lags: no timing rather than a wait
            return None
        try:
            if self._capturing():  # an event in a CUDA graph capture never fires alone
                self._free.append(ev)
                return None
            t0 = self._clock()
            ev.record()  # the current stream of the current device
        except Exception as exc:
            self._free.append(ev)
            self._error("record", exc)
            return None
        self._seq += 1
        token = _Mark(ev, t0, self._seq)
        self._outstanding.append(token)
        return token

    # -- pipeline thread (or the training thread for release) ---------------------------
    def _claim(self, token: _Mark) -> Any:
        with self._lock:
            ev = token.event
            token.event = None
            return ev

    def release(self, tokens: Sequence[Any]) -> None:
        # The tracker shares a step's first/last token with the neighbouring step,
        # which may still be queued: those are left to the sweep in resolve().
        for token in tokens[1:-1]:
            if isinstance(token, _Mark):
                ev = self._claim(token)
                if ev is not None:
                    self._free.append(ev)

    def _sweep(self, before_seq: int) -> None:
        """Free tokens older than the step being resolved that nobody resolved:
        steps are resolved in order, so no queued step still needs them."""
        out = self._outstanding
        while out and out[0].seq < before_seq:
            ev = self._claim(out.popleft())
            if ev is not None:
                self._free.append(ev)

    def resolve(self, marks: Sequence[int], tokens: Sequence[Any]) -> list[int | None] | None:
        if not self._active or self._closed:
            return None
        out: list[int | None] = [None] * len(tokens)
        claimed = []
        first_seq = None
        for i, token in enumerate(tokens):
            if not isinstance(token, _Mark):
                continue
            if first_seq is None:
                first_seq = token.seq
            if token.ns is not None:  # shared with the previous step, already resolved
                out[i] = token.ns
                continue
            ev = self._claim(token)
            if ev is not None:
                claimed.append((i, token, ev))
        if first_seq is not None:
            self._sweep(first_seq)
        if claimed:
            try:
                self._convert(claimed, out)
            except Exception as exc:
                self._error("resolve", exc)
            finally:
                for _, _, ev in claimed:
                    self._free.append(ev)
        if all(v is None for v in out):
            return None
        return DeviceTimes(out)

    def _convert(self, claimed: list, out: list[int | None]) -> None:
        # The last event first: on one stream the others are then done too.
        for _, _, ev in reversed(claimed):
            ev.synchronize()
        ref = self._anchor()
        rel = [self._elapsed_ns(ref, ev) for _, _, ev in claimed]
        est = self._estimator
        # Each event completed after it was submitted (t0): a lower bound of the offset.
        est.add(claimed[-1][1].t0, max(tok.t0 - r for (_, tok, _), r in zip(claimed, rel)))
        # One offset for the whole step, so its durations are pure device intervals.
        offset = est.offset(claimed[-1][1].t0) or 0  # (never None: a bound was just added)
        for (i, token, _), r in zip(claimed, rel):
            token.ns = out[i] = r + offset

    def _anchor(self) -> Any:
        """The reference event, re-anchored every ``anchor_interval_s``."""
        now = self._clock()
        if self._ref is not None and now - self._ref_t0 < self._interval_ns:
            return self._ref
        ev = self._spare
        t0 = self._clock()
        ev.record(self._side)  # an idle non-blocking stream: processed right away
        ev.synchronize()
        if self._ref is not None:
            self._estimator.rebase(self._elapsed_ns(self._ref, ev))
        self._estimator.add(t0, t0)  # in the new frame the anchor is at device time 0
        backend = self._backend
        assert backend is not None  # active
        self._spare, self._ref, self._ref_t0 = self._ref or backend.new_event(), ev, t0
        return ev

    @staticmethod
    def _elapsed_ns(a: Any, b: Any) -> int:
        """Device ns from event ``a`` to event ``b`` (negative if ``b`` came first).
        Both directions are asked so a backend that clamps at 0 still works."""
        ms = a.elapsed_time(b)
        if ms <= 0.0:
            back = b.elapsed_time(a)
            if back > 0.0:
                return -round(back * 1e6)
        return round(ms * 1e6)

    def _error(self, where: str, exc: BaseException) -> None:
        if not self._warned:  # once: the affected marks say the rest
            self._warned = True
            logger.warning(
                "otel-training: CUDA event timing failed in %s (%r); affected marks fall back to host clocks",
                where,
                exc,
            )

    def close(self) -> None:
        self._closed = True
        self._active = False
