"""The ideal step time and the time slower steps lost against it, as
ml-goodput-measurement defines them (aggregate/job.py's ``job`` section)."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

MAD_FACTOR = 3.0  # ml-goodput-measurement: steps above median + 3 MAD are anomalous


def slow_steps(durations: Sequence[float], steps: int, compile_s: float = 0.0) -> tuple:
    """(ideal step time, slow-step badput s, slow steps) from train step times:
    ml-goodput-measurement's ideal step time (the mean of the steps at most median +
    3 MAD), the time steps above that bound lost against it (scaled to ``steps`` when
    ``durations`` was thinned), less ``compile_s`` (compile time inside train steps,
    which is accounted as ``compile``). (None, 0.0, 0) without steps."""
    ds = [d for d in durations if d > 0]
    if not ds:
        return None, 0.0, 0
    med = median(ds)
    mad = median([abs(d - med) for d in ds])
    bound = med + MAD_FACTOR * mad
    normal = [d for d in ds if d <= bound]
    ideal = sum(normal) / len(normal) if normal else med
    slow = [d for d in ds if d > bound]
    scale = steps / len(ds) if steps > len(ds) else 1.0
    lost = sum(d - ideal for d in slow) * scale
    return ideal, max(0.0, lost - compile_s), round(len(slow) * scale)
