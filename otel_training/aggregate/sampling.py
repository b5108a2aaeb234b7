"""Tail capture: which finished steps become traces.

Decided after the step, knowing its duration: the first step, every step slower
than a factor of the running median (per mode), one step in N, and steps that
raised; all under a token bucket so a burst cannot overflow the span queue, and
a traced step's cost (a few hundred microseconds of the pipeline's CPU) stays a
small, bounded share at millisecond steps. One-in-N steps only take a token that
leaves the bucket at least half full: that half is kept for the steps worth a trace
most (slow ones, errors), which one-in-N at short steps would otherwise use up.
"""

from __future__ import annotations

_WINDOW = 101  # steps in the running median
_WARMUP = 10  # steps before "slow" means anything
_REFRESH = 8


class _RunningMedian:
    """Median of the last _WINDOW values, recomputed every _REFRESH values: a
    few steps stale at most, and a sort every few steps instead of an insort each."""

    __slots__ = ("_ring", "_next", "value", "_stale")

    def __init__(self) -> None:
        self._ring: list = []
        self._next = 0
        self.value: int | None = None  # None until _WARMUP values
        self._stale = 0

    def add(self, value: int) -> None:
        ring = self._ring
        if len(ring) < _WINDOW:
            ring.append(value)
        else:
            ring[self._next] = value
            self._next = (self._next + 1) % _WINDOW
        self._stale += 1
        if self._stale >= _REFRESH or self.value is None:
            self._stale = 0
            if len(ring) >= _WARMUP:
                self.value = sorted(ring)[len(ring) // 2]


class TailCapture:
    def __init__(self, slow_factor: float, every_n: int, max_per_second: float) -> None:
        self.slow_factor = slow_factor
        self.every_n = every_n
        self.rate = max_per_second
        self._capacity = max(1.0, max_per_second)
        # One-in-N steps take only tokens above half the bucket (all of a bucket of one).
        self._reserve = max(1.0, min(self._capacity, 1.0 + self._capacity / 2))
        self._tokens = self._capacity
        self._last_refill: int | None = None
        self._medians: dict[str, _RunningMedian] = {}
        self._seen = 0

    def decide(self, mode: str, duration_ns: int, end_ns: int, error: bool) -> str | None:
        """The reason to trace this step (``first``, ``error``, ``slow``,
        ``sampled``) or None. ``end_ns`` is any monotonic clock in ns."""
        seen = self._seen
        self._seen += 1
        med = self._medians.get(mode)
        if med is None:
            med = self._medians[mode] = _RunningMedian()
        median = med.value
        med.add(duration_ns)
        if seen == 0:
            reason = "first"
        elif error:
            reason = "error"
        elif self.slow_factor and median is not None and duration_ns > self.slow_factor * median:
            reason = "slow"
        elif self.every_n and seen % self.every_n == 0:
            return "sampled" if self._take(end_ns, self._reserve) else None
        else:
            return None
        return reason if self._take(end_ns, 1.0) else None

    def take(self, now_ns: int) -> bool:
        """A token for a trace that is no step's (named time between steps)."""
        return self._take(now_ns, 1.0)

    def _take(self, now_ns: int, least: float) -> bool:
        """Take a token if at least ``least`` are in the bucket."""
        if self._last_refill is not None:
            elapsed = (now_ns - self._last_refill) / 1e9
            self._tokens = min(self._capacity, self._tokens + elapsed * self.rate)
        self._last_refill = now_ns
        if self._tokens >= least:
            self._tokens -= 1.0
            return True
        return False
