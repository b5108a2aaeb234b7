"""From host marks and device completion times to phase times and GPU idle time.

Pure functions over plain lists, so they are tested on CPU with a deterministic
device clock (tests/fake_device.py).

Inputs, per step: ``host[k]``, the host time of boundary ``k``; ``device[k]``, when
the device had finished all work issued before boundary ``k`` (what a CUDA event
recorded at the boundary tells: never much earlier than ``host[k]``, later when work
was still queued), or None where unknown; ``arrivals[k]``, when the host reached the
boundary before the timer's own blocking (``host`` itself except in ``sync`` mode;
``DeviceTimes.arrivals`` carries it).
"""

from __future__ import annotations

from collections.abc import Sequence

# Work still queued this long after the host left a stretch means the device was
# kept busy; below it, the device had caught up (covers event latency and the
# few-microsecond uncertainty of the device-to-host clock mapping).
BUSY_TOLERANCE_NS = 50_000


def synchronized_marks(host: Sequence[int], device: Sequence[int | None] | None) -> list[int]:
    """GPU-synchronized time of each boundary: when the device had finished the
    work issued before it (never earlier than the host reached the boundary)."""
    if device is None:
        return list(host)
    out = []
    last = None
    for h, d in zip(host, device):
        t = h if d is None or d < h else d
        if last is not None and t < last:  # completions are ordered on a stream
            t = last
        out.append(t)
        last = t
    return out


def interval_idle(
    host: Sequence[int],
    device: Sequence[int | None] | None,
    arrivals: Sequence[int] | None = None,
    tolerance_ns: int = BUSY_TOLERANCE_NS,
) -> list[int]:
    """Nanoseconds the device sat idle between consecutive marks ``k`` and ``k+1``
    (``len(host) - 1`` values; all 0 when the device is not observed).

    The device finished the work issued before ``k`` at ``device[k]`` and sat idle
    from then until the host reached ``k+1`` -- unless work issued in between kept
    it busy. Boundary events cannot see inside a stretch, so:

    * if work issued in the stretch was still queued when the host reached ``k+1``
      (``device[k+1]`` later than the arrival by more than ``tolerance_ns``), the
      device counts as fed: 0 (GPU-bound phases);
    * otherwise the idle time is ``host[k+1] - max(host[k], device[k])``: exact when
      the stretch issued no device work (``dataloader_next``: the wait minus the
      tail of the previous step's queued work), an upper bound otherwise (a phase
      that launches small kernels slower than the device runs them counts their
      device time as idle too).

    Unknown device times (None) give 0.
    """
    n = len(host)
    if device is None or n < 2:
        return [0] * max(n - 1, 0)
    if arrivals is None:
        arrivals = getattr(device, "arrivals", None) or host
    out = []
    for k in range(n - 1):
        d0, d1 = device[k], device[k + 1]
        if d0 is None or d1 is None or d1 - arrivals[k + 1] > tolerance_ns:
            out.append(0)
            continue
        h0 = host[k]
        idle = host[k + 1] - (d0 if d0 > h0 else h0)
        out.append(idle if idle > 0 else 0)
    return out


def idle_between(
    host: Sequence[int],
    device: Sequence[int | None] | None,
    start: int,
    end: int,
    arrivals: Sequence[int] | None = None,
    tolerance_ns: int = BUSY_TOLERANCE_NS,
) -> int:
    """Nanoseconds the device sat idle while the host went from mark ``start`` to
    mark ``end``: the sum of ``interval_idle`` over the stretches in between, so
    phases and the gaps between them add up to the step. 0 when the device is not
    observed."""
    if device is None or end <= start:
        return 0
    if arrivals is None:
        arrivals = getattr(device, "arrivals", None)
    window = slice(start, end + 1)
    return sum(
        interval_idle(host[window], device[window], arrivals[window] if arrivals is not None else None, tolerance_ns)
    )
