"""Per-step metrics: synchronous instruments, so traced steps carry exemplars."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from otel_training import semconv as sc


class StepMetrics:
    """Records one finished step's durations, counts and GPU idle time."""

    def __init__(self, meter, common: dict) -> None:
        hist = dict(unit="s", explicit_bucket_boundaries_advisory=list(sc.DURATION_BUCKETS))
        self._step = meter.create_histogram(
            sc.METRIC_STEP_DURATION, description="Duration of a training or eval step", **hist)
        self._phase = meter.create_histogram(
            sc.METRIC_PHASE_DURATION, description="Time a step spent in each phase", **hist)
        self._steps = meter.create_counter(sc.METRIC_STEPS, unit="{step}", description="Steps completed")
        self._samples = meter.create_counter(
            sc.METRIC_SAMPLES, unit="{sample}", description="Samples processed (inferred batch sizes)")
        self._idle = meter.create_counter(
            sc.METRIC_GPU_IDLE, unit="s", description="Time the GPU sat idle, by the phase the host was in")
        self._common = dict(common)
        # Attribute dicts are built once and reused: no per-step allocation.
        self._mode_attrs: Dict[str, dict] = {}
        self._phase_attrs: Dict[Tuple[str, str, str], dict] = {}
        self._idle_attrs: Dict[Tuple[str, str], dict] = {}
        # Counters are summed here and added once per pipeline drain (cheaper).
        self._pending: Dict[str, list] = {}

    def _for_mode(self, mode: str) -> dict:
        attrs = self._mode_attrs.get(mode)
        if attrs is None:
            attrs = self._mode_attrs[mode] = {**self._common, sc.ATTR_MODE: mode}
        return attrs

    def record(self, mode: str, duration_s: float, phases: Dict[Tuple[str, str], int],
               idle: Optional[Dict[str, float]], batch_size: Optional[int], context=None) -> None:
        attrs = self._for_mode(mode)
        self._step.record(duration_s, attrs, context=context)
        phase_attrs = self._phase_attrs
        record = self._phase.record
        for key, seconds in phases.items():  # nanoseconds in, seconds out
            a = phase_attrs.get((mode,) + key)
            if a is None:
                a = phase_attrs[(mode,) + key] = {
                    **attrs, sc.ATTR_PHASE: key[0], sc.ATTR_PHASE_PARENT: key[1]}
            record(seconds / 1e9, a, context=context)
        pending = self._pending.get(mode)
        if pending is None:
            pending = self._pending[mode] = [0, 0]
        pending[0] += 1
        pending[1] += batch_size or 0
        if idle:
            for name, seconds in idle.items():
                if seconds > 0:
                    a = self._idle_attrs.get((mode, name))
                    if a is None:
                        a = self._idle_attrs[(mode, name)] = {**attrs, sc.ATTR_PHASE: name}
                    self._idle.add(seconds, a)

    def flush(self) -> None:
        """Add the step and sample counts gathered since the last flush."""
        for mode, pending in self._pending.items():
            if pending[0]:
                attrs = self._for_mode(mode)
                self._steps.add(pending[0], attrs)
                if pending[1]:
                    self._samples.add(pending[1], attrs)
                pending[0] = pending[1] = 0
