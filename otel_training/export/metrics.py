"""The metrics consumer: step and phase histograms with exemplars, step counters.

Histograms go through a ``HistogramBank`` (binned here, merged into each SDK
reader's collection) when the SDK set-up allows it exactly, else through the SDK
instruments. Either way traced steps carry exemplars. Untraced steps are queued
for the bank a layout run at a time (``layout_queues.py``, private to this consumer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context

from otel_training import semconv as sc
from otel_training.aggregate.step_record import IDLE_NS, StepRecord
from otel_training.export.histograms import HistogramBank, Series, bank_for
from otel_training.export.layout_queues import LayoutQueues

if TYPE_CHECKING:
    from otel_training.aggregate.between import BetweenRecord

_UNTRACKED_KEY = (sc.PHASE_UNTRACKED, sc.SPAN_STEP)
_STEP_DESCRIPTION = "Duration of a training or eval step"
_PHASE_DESCRIPTION = "Time a step spent in each phase"


class StepMetrics:
    """Records finished steps' durations, counts and GPU idle time (pipeline thread)."""

    def __init__(
        self,
        meter,
        common: dict,
        meter_provider: Any = None,
        scope_version: str = "",
        on_error: Callable[[BaseException], None] | None = None,
        offset: int = 0,
    ) -> None:
        hist = dict(unit="s", explicit_bucket_boundaries_advisory=list(sc.DURATION_BUCKETS))
        self._step = meter.create_histogram(sc.METRIC_STEP_DURATION, description=_STEP_DESCRIPTION, **hist)
        self._phase = meter.create_histogram(sc.METRIC_PHASE_DURATION, description=_PHASE_DESCRIPTION, **hist)
        self._steps = meter.create_counter(sc.METRIC_STEPS, unit="{step}", description="Steps completed")
        self._samples = meter.create_counter(
            sc.METRIC_SAMPLES, unit="{sample}", description="Samples processed (inferred batch sizes)"
        )
        self._microbatches = meter.create_counter(
            sc.METRIC_MICROBATCHES,
            unit="{microbatch}",
            description="Micro-batches of training steps (backward passes accumulated into an update)",
        )
        self._skipped = meter.create_counter(
            sc.METRIC_SKIPPED_UPDATES,
            unit="{step}",
            description="Training steps whose optimizer update was skipped (GradScaler found inf/NaN)",
        )
        self._idle = meter.create_counter(
            sc.METRIC_GPU_IDLE, unit="s", description="Time the GPU sat idle, by the phase the host was in"
        )
        self._common = dict(common)
        # Bins the histograms here, or None where the SDK records them itself.
        self.bank: HistogramBank | None = None
        if meter_provider is not None:
            self.bank = bank_for(
                meter_provider, type(self._step), sc.SCOPE, scope_version, sc.DURATION_BUCKETS, on_error
            )
        if self.bank is not None:
            self._fast_step = self.bank.histogram(sc.METRIC_STEP_DURATION, "s", _STEP_DESCRIPTION)
            self._fast_phase = self.bank.histogram(sc.METRIC_PHASE_DURATION, "s", _PHASE_DESCRIPTION)
        # Attribute dicts (and series) are built once and reused: no per-step allocation.
        self._mode_attrs: dict[str, dict] = {}
        self._phase_attrs: dict[tuple[str, str, str], Series] = {}
        self._step_series: dict[str, Series] = {}
        self._idle_attrs: dict[tuple[str, str], dict] = {}
        # Counters are summed here and added once per pipeline drain (cheaper).
        self._pending: dict[str, list] = {}
        self._queued_steps = 0  # steps whose values were queued since the last flush
        self._offset = offset  # perf_counter ns -> epoch ns (exemplar times)
        self._queues = LayoutQueues(self, self.bank) if self.bank is not None else None

    def rebind(self, common: dict) -> None:
        """Record under ``common`` (the rank, once known) from now on: the cached
        attribute sets are made again, in new dicts (the pipeline thread may hold the old)."""
        self._common = dict(common)
        self._mode_attrs = {}
        self._phase_attrs = {}
        self._step_series = {}
        self._idle_attrs = {}
        if self.bank is not None:
            self._queues = LayoutQueues(self, self.bank)

    def add(self, records: Sequence[StepRecord], contexts: dict[int, Context]) -> None:
        """A batch of finished steps; ``contexts``: per traced record (``id``), the
        context holding its step span (exemplars)."""
        queues = self._queues
        if queues is None:  # the SDK records every step
            for record in records:
                self._record_one(record, contexts.get(id(record)) if contexts else None)
        else:
            # Untraced runs go to the queues in bulk, traced steps one by one (with
            # their exemplars), in step order (sums as the SDK's).
            traced = [i for i, key in enumerate(map(id, records)) if key in contexts] if contexts else ()
            start = 0
            for i in traced:
                if i > start:
                    queues.add(records[start:i])
                self._record_one(records[i], contexts[id(records[i])])
                start = i + 1
            if start < len(records):
                queues.add(records[start:] if start else records)
        if any(map(IDLE_NS, records)):
            for record in records:
                if record.idle_ns:
                    self._add_idle(record.mode, record.idle_ns)

    def add_between(self, record: BetweenRecord) -> None:
        """Named time between steps (``aggregate.between.BetweenRecord``): a
        ``training.phase.duration`` point per phase, ``training.mode="between_steps"``."""
        mode = sc.MODE_BETWEEN
        values = [(self.phase_handle(mode, (p.name, p.parent)), (p.end - p.start) / 1e9) for p in record.phases]
        bank = self.bank
        if bank is not None:
            with bank.lock:
                bank.add_all(values)
        else:
            for handle, seconds in values:
                self._phase.record(seconds, handle.attributes)

    def _record_one(self, r: StepRecord, context: Context | None) -> None:
        handle = self.phase_handle
        mode = r.mode
        phases = [(handle(mode, key), ns / 1e9) for key, ns in zip(r.layout.keys, r.phase_ns)]
        if r.untracked_ns > 0:
            phases.append((handle(mode, _UNTRACKED_KEY), r.untracked_ns / 1e9))
        self.record_phases(
            mode,
            r.step_ns / 1e9,
            phases,
            None,
            r.batch_size,
            context,
            self._offset + r.times[-1],
            r.microbatches,
            r.skipped,
        )

    def _for_mode(self, mode: str) -> dict:
        attrs = self._mode_attrs.get(mode)
        if attrs is None:
            attrs = self._mode_attrs[mode] = {**self._common, sc.ATTR_MODE: mode}
        return attrs

    def phase_handle(self, mode: str, key: tuple[str, str]) -> Series:
        """The handle ``record_phases`` takes for phase ``key`` (name, parent) in
        ``mode``: made once, so recording builds no attributes. The bank's series,
        or one of no buckets that only holds the attributes for the SDK."""
        handle = self._phase_attrs.get((mode,) + key)
        if handle is None:
            attrs = self._phase_attributes(self._for_mode(mode), key)
            if self.bank is not None:
                with self.bank.lock:  # the collecting thread iterates the series
                    handle = self._fast_phase.series(attrs)
            else:
                handle = Series(attrs, 0)
            self._phase_attrs[(mode,) + key] = handle
        return handle

    def step_series(self, mode: str, bank: HistogramBank) -> Series:
        """The step-duration series of ``mode`` in ``bank`` (this consumer's)."""
        series = self._step_series.get(mode)
        if series is None:
            with bank.lock:
                series = self._step_series[mode] = self._fast_step.series(self._for_mode(mode))
        return series

    def count(
        self, mode: str, steps: int, samples: int, queued: bool = True, microbatches: int = 0, skipped: int = 0
    ) -> None:
        """``steps`` more steps (``samples`` samples, ``microbatches``, ``skipped``
        updates) for the counters, added at ``flush``; ``queued``: their values went
        through the queues (``queue_for``)."""
        pending = self._pending.get(mode)
        if pending is None:
            pending = self._pending[mode] = [0, 0, 0, 0]
        pending[0] += steps
        pending[1] += samples
        if microbatches:
            pending[2] += microbatches
        if skipped:
            pending[3] += skipped
        if queued:
            self._queued_steps += steps

    def record_phases(
        self,
        mode: str,
        duration_s: float,
        phases: list[tuple[Series, float]],
        idle: dict[str, float] | None,
        batch_size: int | None,
        context: Context | None = None,
        end_ns: int = 0,
        microbatches: int = 0,
        skipped: int = 0,
    ) -> None:
        """One step: ``phases`` as (``phase_handle``, seconds); ``context`` holds the
        step's span when traced; ``end_ns``: the step's end, epoch ns (the exemplar's time)."""
        attrs = self._for_mode(mode)
        bank = self.bank
        if bank is not None:
            exemplar = None
            if context is not None:
                ctx = trace.get_current_span(context).get_span_context()
                if ctx.is_valid and ctx.trace_flags.sampled:
                    exemplar = (ctx.trace_id, ctx.span_id, end_ns)
            phases.append((self.step_series(mode, bank), duration_s))
            with bank.lock:
                bank.add_all(phases, exemplar)
        else:
            self._step.record(duration_s, attrs, context=context)
            record = self._phase.record
            for handle, seconds in phases:
                record(seconds, handle.attributes, context=context)
        self.count(mode, 1, batch_size or 0, queued=False, microbatches=microbatches, skipped=skipped)
        if idle:
            self._add_idle(mode, {name: int(seconds * 1e9) for name, seconds in idle.items()})

    def _add_idle(self, mode: str, idle_ns: dict[str, int]) -> None:
        attrs = self._for_mode(mode)
        for name, ns in idle_ns.items():
            if ns > 0:
                a = self._idle_attrs.get((mode, name))
                if a is None:
                    a = self._idle_attrs[(mode, name)] = {**attrs, sc.ATTR_PHASE: name}
                self._idle.add(ns / 1e9, a)

    @staticmethod
    def _phase_attributes(attrs: dict, key: tuple[str, str]) -> dict:
        return {**attrs, sc.ATTR_PHASE: key[0], sc.ATTR_PHASE_PARENT: key[1]}

    def flush(self) -> None:
        """Add the step and sample counts gathered since the last flush (and let the
        bank bin queued values once enough have gathered)."""
        if self._queued_steps and self.bank is not None:
            with self.bank.lock:
                self.bank.queued(self._queued_steps)
            self._queued_steps = 0
        for mode, pending in self._pending.items():
            if pending[0]:
                attrs = self._for_mode(mode)
                self._steps.add(pending[0], attrs)
                if pending[1]:
                    self._samples.add(pending[1], attrs)
                if pending[2]:
                    self._microbatches.add(pending[2], attrs)
                if pending[3]:
                    self._skipped.add(pending[3], attrs)
                pending[0] = pending[1] = pending[2] = pending[3] = 0
