"""A simulated CUDA device for CPU tests of device timing and GPU idle attribution.

Deterministic: one controllable host clock (``SimClock``, in ns) drives everything.
Each ``SimStream`` is a FIFO work queue: work launched at host time ``t`` starts at
``max(t, the stream's previous completion)``. The device has its own clock (an offset
and a drift from the host clock) and CUDA-like events (``SimEvent``: ``record``,
``query``, ``synchronize``, ``elapsed_time`` in float32 milliseconds, an error when
not complete), so the real ``CudaEventTimer`` runs on it through ``SimBackend``.

``OracleTimer`` is a DeviceTimer whose tokens resolve to the exact simulated
completion times; ``SimLoop`` plays the tracker (``token = timer.mark()`` then the
host timestamp, phases as ``PhaseRecord``) and produces real ``StepTimeline``s;
``SimDevice.idle_ns`` is the ground truth the attribution is checked against.
"""

from __future__ import annotations

import struct
from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Sequence, Tuple

from otel_training.timing.device import DeviceTimer, DeviceTimes
from otel_training.record.timeline import PhaseRecord, StepTimeline

MS = 1_000_000
US = 1_000


class SimClock:
    """The host clock: ``clock()`` is the simulated ``perf_counter_ns``."""

    def __init__(self, start_ns: int = 5_000_000_000):
        self.now = start_ns

    def __call__(self) -> int:
        return self.now

    def advance(self, ns: float) -> None:
        self.now += int(ns)

    def advance_to(self, t: int) -> None:
        if t > self.now:
            self.now = t


class SimStream:
    def __init__(self, device: "SimDevice", name: str, shares_queue: bool = False):
        self.device = device
        self.name = name
        self.busy_until = 0  # host-clock time its queued work completes
        self.busy: List[Tuple[int, int]] = []  # (start, end) of each work item
        # Like CUDA_DEVICE_MAX_CONNECTIONS=1: records wait behind the default stream too.
        self.shares_queue = shares_queue

    def completion(self) -> int:
        """When all work queued so far has completed (now, if idle)."""
        return max(self.device.clock.now, self.busy_until)


class SimDevice:
    """Streams, a device clock and the host-side costs of talking to the device."""

    def __init__(self, clock: Optional[SimClock] = None, *, offset_ns: int = -3_210_987_654_321,
                 drift: float = 0.0, record_latency_ns: int = 2 * US, record_cost_ns: int = 1 * US,
                 launch_cost_ns: int = 5 * US, clamp_negative: bool = False,
                 side_shares_queue: bool = False):
        self.clock = clock or SimClock()
        self.offset_ns = offset_ns
        self.drift = drift
        self.record_latency_ns = record_latency_ns  # submit -> the GPU timestamps the event
        self.record_cost_ns = record_cost_ns  # host time of an event record call
        self.launch_cost_ns = launch_cost_ns  # host time of a kernel launch
        self.clamp_negative = clamp_negative  # elapsed_time never < 0
        self.side_shares_queue = side_shares_queue
        self.default = SimStream(self, "default")
        self.current = self.default
        self.initialized = True
        self.capturing = False
        self.syncs = 0

    # -- the device clock ----------------------------------------------------------------
    def device_ts(self, host_ns: int) -> int:
        return self.offset_ns + host_ns + int(self.drift * host_ns)

    # -- host-side operations (what a training loop does) -------------------------------
    def launch(self, device_ns: float, stream: Optional[SimStream] = None, host_ns: Optional[float] = None) -> int:
        """Launch a kernel: the host pays the launch cost, the stream queues the work."""
        self.clock.advance(self.launch_cost_ns if host_ns is None else host_ns)
        s = stream or self.current
        start = max(self.clock.now, s.busy_until)
        end = start + int(device_ns)
        s.busy_until = end
        s.busy.append((start, end))
        return end

    def copy_h2d(self, device_ns: float, *, non_blocking: bool, pinned: bool, host_ns: float = 10 * US) -> None:
        """``tensor.to(device, non_blocking=...)``: asynchronous only from pinned memory
        with non_blocking; otherwise the host waits for the copy."""
        end = self.launch(device_ns, host_ns=host_ns)
        if not (non_blocking and pinned):
            self.clock.advance_to(end)

    def item(self, device_ns: float = 5 * US) -> None:
        """``.item()``: a small device-to-host copy the host waits for."""
        self.clock.advance_to(self.launch(device_ns))

    def synchronize(self) -> None:
        self.syncs += 1
        self.clock.advance_to(max(s.busy_until for s in self._streams()))

    def new_stream(self, name: str = "user", shares_queue: bool = False) -> SimStream:
        s = SimStream(self, name, shares_queue)
        self._extra = getattr(self, "_extra", []) + [s]
        return s

    def _streams(self) -> List[SimStream]:
        return [self.default] + getattr(self, "_extra", [])

    @contextmanager
    def stream(self, s: SimStream):
        """``with torch.cuda.stream(s)``."""
        prev, self.current = self.current, s
        try:
            yield s
        finally:
            self.current = prev

    @staticmethod
    def wait_stream(waiter: SimStream, other: SimStream) -> None:
        """``waiter.wait_stream(other)``: later work on ``waiter`` starts after ``other``'s."""
        waiter.busy_until = max(waiter.busy_until, other.busy_until)

    # -- ground truth ----------------------------------------------------------------------
    def idle_ns(self, start: int, end: int, stream: Optional[SimStream] = None) -> int:
        """Time in [start, end] during which ``stream`` (default: the default stream)
        ran no work."""
        s = stream or self.default
        busy = 0
        for a, b in s.busy:
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                busy += hi - lo
        return (end - start) - busy


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


class SimEvent:
    """A CUDA timing event on the simulated device (the torch.cuda.Event calls we use)."""

    def __init__(self, device: SimDevice):
        self.device = device
        self.done_at: Optional[int] = None  # host-clock time the device processes it
        self.records = 0

    def record(self, stream: Optional[SimStream] = None) -> None:
        dev = self.device
        s = stream or dev.current
        dev.clock.advance(dev.record_cost_ns)
        queued = s.busy_until
        if s.shares_queue:
            queued = max(queued, dev.default.busy_until)
        self.done_at = max(dev.clock.now + dev.record_latency_ns, queued)
        self.records += 1

    def query(self) -> bool:
        return self.done_at is None or self.done_at <= self.device.clock.now

    def synchronize(self) -> None:
        # Single-threaded simulation: waiting means the shared clock moves on.
        if self.done_at is not None:
            self.device.clock.advance_to(self.done_at)

    def elapsed_time(self, end: "SimEvent") -> float:
        if self.done_at is None or end.done_at is None:
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        dev = self.device
        ms = (dev.device_ts(end.done_at) - dev.device_ts(self.done_at)) / 1e6
        ms = round(ms * 2000) / 2000  # the GPU timer's ~0.5 us resolution
        if dev.clamp_negative and ms < 0:
            ms = 0.0
        return _f32(ms)


class SimBackend:
    """Stands in for ``cuda_events.TorchCudaBackend``."""

    def __init__(self, device: SimDevice):
        self.device = device
        self.clock = device.clock
        self.events_created = 0

    def ready(self) -> bool:
        return self.device.initialized

    def current_device(self) -> int:
        return 0

    def new_event(self) -> SimEvent:
        self.events_created += 1
        return SimEvent(self.device)

    def new_stream(self, device: int) -> SimStream:
        return self.device.new_stream("otel-side", shares_queue=self.device.side_shares_queue)

    def capturing(self) -> bool:
        return self.device.capturing

    def synchronize(self) -> None:
        self.device.synchronize()


class OracleTimer(DeviceTimer):
    """Tokens are the exact completion time of the work queued on the current stream."""

    mode = "events"
    observes_device = True

    def __init__(self, device: SimDevice):
        self.device = device

    def mark(self) -> Any:
        return self.device.current.completion()

    def resolve(self, marks: Sequence[int], tokens: Sequence[Any]) -> Optional[List[Optional[int]]]:
        if all(t is None for t in tokens):
            return None
        return DeviceTimes(list(tokens))


class SimLoop:
    """Plays the tracker: marks boundaries in the tracker's order (token, then host
    time) and records phases into ``StepTimeline``s."""

    def __init__(self, device: SimDevice, timer: DeviceTimer):
        self.device = device
        self.clock = device.clock
        self.timer = timer
        self.steps: List[StepTimeline] = []
        self.step: Optional[StepTimeline] = None
        self._stack: List[PhaseRecord] = []

    def _mark(self) -> int:
        step = self.step
        step.tokens.append(self.timer.mark())
        step.marks.append(self.clock())
        return len(step.marks) - 1

    def begin_step(self) -> None:
        """Start a step; like the tracker's start_step, the previous one ends at the
        same mark (the token is shared)."""
        token = self.timer.mark()
        now = self.clock()
        if self.step is not None:
            self.step.tokens.append(token)
            self.step.marks.append(now)
            self.steps.append(self.step)
        self.step = StepTimeline(len(self.steps), 0)
        self.step.tokens.append(token)
        self.step.marks.append(now)
        self._stack = []

    def end(self) -> None:
        """End the last step with its own mark."""
        if self.step is not None:
            self._mark()
            self.steps.append(self.step)
            self.step = None

    @contextmanager
    def phase(self, name: str):
        up = self._stack[-1] if self._stack else None
        rec = PhaseRecord(name, up.name if up else "step", self._mark(), True, up)
        self.step.phases.append(rec)
        self._stack.append(rec)
        try:
            yield rec
        finally:
            self._stack.pop()
            rec.end = self._mark()

    def top_phases(self, step: StepTimeline) -> Dict[str, List[PhaseRecord]]:
        out: Dict[str, List[PhaseRecord]] = {}
        for rec in step.phases:
            if rec.up is None:
                out.setdefault(rec.name, []).append(rec)
        return out
