"""Device timers: host clocks, ``sync`` and CUDA ``events`` (docs/gpu-timing.md).

``make_timer`` picks one for an ``OTEL_TRAINING_GPU_TIMING`` value. torch is
imported lazily: this package imports without it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from otel_training.timing.device import MODES, DeviceTimer

logger = logging.getLogger("otel_training")


def make_timer(mode: str, **options: Any) -> DeviceTimer:
    """The timer for an ``OTEL_TRAINING_GPU_TIMING`` value; never raises.

    ``auto``: ``off`` when torch is imported without usable CUDA; otherwise an
    events timer that stays inert (mode ``off``) until CUDA is initialized by the
    program -- we never initialize CUDA ourselves -- and then becomes ``events``.
    ``events``/``sync`` without usable CUDA fall back to ``off`` with one log line.
    ``options`` go to the timer (tests, benchmarks).
    """
    mode = (mode or "auto").strip().lower()
    if mode == "off":
        return DeviceTimer()
    if mode not in MODES:
        logger.warning("otel-training: unknown GPU timing mode %r; using host clocks", mode)
        return DeviceTimer()
    try:
        if options.get("backend") is None:
            torch = sys.modules.get("torch")
            if torch is None and mode != "auto":
                try:
                    import torch  # explicit events/sync: the program uses torch anyway
                except Exception as exc:
                    logger.warning(
                        "otel-training: OTEL_TRAINING_GPU_TIMING=%s but torch is unusable (%r); using host clocks",
                        mode,
                        exc,
                    )
                    return DeviceTimer()
            if torch is not None and not _cuda_available(torch):
                if mode != "auto":
                    logger.warning(
                        "otel-training: OTEL_TRAINING_GPU_TIMING=%s but CUDA is not available; using host clocks", mode
                    )
                return DeviceTimer()
        if mode == "sync":
            from otel_training.timing.sync import SyncTimer

            return SyncTimer(**options)
        from otel_training.timing.cuda_events import CudaEventTimer

        return CudaEventTimer(**options)
    except Exception as exc:  # never let timing break training
        logger.warning("otel-training: GPU timing %r unavailable (%r); using host clocks", mode, exc)
        return DeviceTimer()


def _cuda_available(torch: Any) -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False
