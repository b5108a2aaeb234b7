"""From host marks and device completion times to phase times and GPU idle time.

Pure functions over plain lists, so they are tested on CPU with a deterministic
device clock.
"""

from __future__ import annotations

from typing import List, Optional, Sequence


def synchronized_marks(host: Sequence[int], device: Optional[Sequence[Optional[int]]]) -> List[int]:
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


def idle_between(host: Sequence[int], device: Optional[Sequence[Optional[int]]], start: int, end: int) -> int:
    """Nanoseconds the device certainly sat idle while the host went from mark
    ``start`` to mark ``end``: from when all work issued before ``end`` had
    completed (``device[end]``, raw, possibly before the host got there) until the
    host reached ``end``. 0 when the device is not observed."""
    if device is None or device[end] is None:
        return 0
    busy_until = device[end]
    begin = host[start] if host[start] > busy_until else busy_until
    idle = host[end] - begin
    return idle if idle > 0 else 0
