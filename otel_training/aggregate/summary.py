"""The run summary: per-mode step and phase totals, from finished-step records.

A consumer of ``StepRecord`` batches (pipeline thread); ``to_dict`` is read from any
thread. Rendering it as text lives in ``otel_training.diagnosis.summary_text``.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from collections.abc import Sequence
from itertools import groupby, repeat
from operator import sub, truediv
from typing import TYPE_CHECKING

from otel_training import semconv as sc
from otel_training.aggregate.run_model import SCHEMA, Flops, Mode, Phase, Run, Telemetry
from otel_training.aggregate.step_record import (
    BATCH_SIZE,
    BY_LAYOUT,
    IDLE_NS,
    MICROBATCHES,
    PHASE_NS,
    SKIPPED,
    TOKENS,
    UNTRACKED_KEY,
    UNTRACKED_NS,
    Layout,
    StepRecord,
    bounds,
)
from otel_training.files import check_writable, expand
from otel_training.record.flops import SOURCE_MEASURED

if TYPE_CHECKING:
    from otel_training.record.flops import FlopCount

_MAX_DURATIONS = 200_000  # per mode, for percentiles; older ones are thinned out
_MAX_CACHED = 1024  # layouts whose phase totals are looked up once


class _ModeStats:
    __slots__ = (
        "steps",
        "samples",
        "microbatches",
        "skipped",
        "step_ns",
        "phases",
        "idle_ns",
        "durations",
        "first_start",
        "last_end",
        "tokens",
        "flops",
        "flop_ns",
        "flop_count",
        "counted",
    )

    def __init__(self) -> None:
        self.steps = 0
        self.samples = 0
        self.microbatches = 0
        self.skipped = 0
        self.step_ns = 0
        self.phases: dict[tuple[str, str], list] = {}  # (name, parent) -> [total ns, count]
        self.idle_ns: dict[str, int] = {}
        self.durations = array("d")
        self.first_start: int | None = None
        self.last_end: int | None = None
        self.tokens = 0
        self.flops = 0.0  # FLOPs of the steps with a known count
        self.flop_ns = 0  # and their step time
        self.flop_count: FlopCount | None = None
        # The step the FLOPs were counted on (slower: FLOP counting): number, ns,
        # samples, tokens. Left out of the step-time statistics and throughput.
        self.counted: tuple[int, int, int, int] | None = None

    def phase(self, key: tuple[str, str]) -> list:
        """The ``[total ns, steps]`` of phase ``key`` (name, parent)."""
        slot = self.phases.get(key)
        if slot is None:
            slot = self.phases[key] = [0, 0]
        return slot


def _pct(ordered: list, q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class RunSummary:
    """Totals of finished steps. ``add`` runs on the pipeline thread; ``to_dict`` may
    run on any (both under ``_lock``)."""

    def __init__(self, resource_info: dict, timing: str) -> None:
        self.info = dict(resource_info)
        self.timing = timing
        self.started_at = time.time()
        self._modes: dict[str, _ModeStats] = {}
        self._slots: dict[Layout, list[list]] = {}  # a layout's phase totals, in key order
        self._lock = threading.Lock()

    def _mode(self, mode: str) -> _ModeStats:
        m = self._modes.get(mode)
        if m is None:
            m = self._modes[mode] = _ModeStats()
        return m

    def add(self, records: Sequence[StepRecord]) -> None:
        """Count a batch of finished steps, a run of one layout at a time."""
        with self._lock:
            for layout, run in groupby(records, BY_LAYOUT):
                self._add_run(layout, list(run))
            if records:
                self.timing = records[-1].timing

    def _add_run(self, layout: Layout, run: list[StepRecord]) -> None:
        m = self._mode(layout.mode)
        count = run[-1].flops
        if count is not None and m.flop_count is None and count.source == SOURCE_MEASURED:
            # The FLOP-count step is in this run (the first record carrying the count):
            # counted as a step, kept out of the statistics.
            i = next(i for i, r in enumerate(run) if r.flops is not None)
            r = run[i]
            m.counted = (r.number, r.step_ns, r.batch_size or 0, r.tokens or 0)
            m.steps += 1
            m.samples += r.batch_size or 0
            m.tokens += r.tokens or 0
            m.microbatches += r.microbatches
            m.skipped += r.skipped
            m.flop_count = count
            m.flops += count.per_step  # (in the total; not in FLOP/s, as its time is not)
            start, end = r.times[0], r.times[-1]
            m.first_start = start if m.first_start is None else min(m.first_start, start)
            m.last_end = end if m.last_end is None else max(m.last_end, end)
            run = run[:i] + run[i + 1 :]
            if not run:
                return
            count = run[-1].flops
        n = len(run)
        slots = self._slots.get(layout)
        if slots is None:
            slots = [m.phase(key) for key in layout.keys]
            if len(self._slots) < _MAX_CACHED:
                self._slots[layout] = slots
        if slots:
            for slot, ns in zip(slots, map(sum, zip(*map(PHASE_NS, run)))):
                slot[0] += ns
                slot[1] += n
        untracked = [u for u in map(UNTRACKED_NS, run) if u > 0]
        if untracked:
            slot = m.phase(UNTRACKED_KEY)
            slot[0] += sum(untracked)
            slot[1] += len(untracked)
        starts, ends = bounds(run)
        step_ns = list(map(sub, ends, starts))
        m.steps += n
        m.step_ns += sum(step_ns)
        m.samples += sum(filter(None, map(BATCH_SIZE, run)))
        m.microbatches += sum(map(MICROBATCHES, run))
        m.skipped += sum(map(SKIPPED, run))
        m.tokens += sum(filter(None, map(TOKENS, run)))
        if count is not None:  # known from some step on, then on every training step
            i = 0 if run[0].flops is not None else next(i for i, r in enumerate(run) if r.flops is not None)
            m.flops += count.per_step * (n - i)
            m.flop_ns += sum(step_ns[i:])
            m.flop_count = count
        first, last = min(starts), max(ends)  # (steps may come in out of order)
        if m.first_start is None or first < m.first_start:
            m.first_start = first
        if m.last_end is None or last > m.last_end:
            m.last_end = last
        m.durations.extend(map(truediv, step_ns, repeat(1e9)))
        while len(m.durations) > _MAX_DURATIONS:
            m.durations = m.durations[::2]
        for idle in filter(None, map(IDLE_NS, run)):
            for name, ns in idle.items():
                m.idle_ns[name] = m.idle_ns.get(name, 0) + ns

    def step_durations(self, mode: str) -> tuple[list[float], int]:
        """The step times (s) of ``mode`` kept for percentiles (thinned in a long run),
        and how many steps they stand for (the FLOP-count step left out)."""
        with self._lock:
            m = self._modes.get(mode)
            if m is None:
                return [], 0
            return m.durations.tolist(), m.steps - (m.counted is not None)

    def to_dict(self, telemetry: dict | None = None) -> dict:
        """The summary's head, ``modes`` and ``telemetry`` as the file's dict."""
        with self._lock:
            modes = self._modes_section()
            timing, ended = self.timing, time.time()
        return {
            "schema": SCHEMA,
            **self.info,
            "timing": timing,
            "started_at": self.started_at,
            "ended_at": ended,
            "modes": {mode: m.to_dict() for mode, m in modes.items()},
            "telemetry": Telemetry(**telemetry).to_dict() if telemetry else Telemetry().to_dict(),
        }

    def section(self) -> tuple[str, dict[str, Mode]]:
        """The timing mode and the ``modes`` section, mode by mode."""
        with self._lock:
            return self.timing, self._modes_section()

    def _modes_section(self) -> dict[str, Mode]:
        modes = {}
        for mode, m in self._modes.items():
            step_s = m.step_ns / 1e9
            timed = m.steps - (m.counted is not None)
            ds = sorted(m.durations)
            phases = tuple(
                Phase(
                    name=name,
                    parent=parent,
                    total_s=ns / 1e9,
                    mean_s=ns / 1e9 / timed if timed else 0.0,
                    count=count,
                    share=(ns / m.step_ns) if m.step_ns else 0.0,
                )
                for (name, parent), (ns, count) in sorted(m.phases.items(), key=lambda kv: -kv[1][0])
            )
            wall_s = ((m.last_end or 0) - (m.first_start or 0)) / 1e9
            # Throughput: the mode's samples (tokens) over its own summed step time, not
            # the wall time from its first step to its last (eval between training
            # epochs would hold whole epochs of training), the FLOP-count step left out.
            _, _, c_samples, c_tokens = m.counted or (0, 0, 0, 0)
            train = mode == sc.MODE_TRAIN
            modes[mode] = Mode(
                steps=m.steps,
                timed_steps=timed,
                samples=m.samples,
                tokens=m.tokens,
                samples_per_s=(m.samples - c_samples) / step_s if step_s > 0 else 0.0,
                tokens_per_s=(m.tokens - c_tokens) / step_s if step_s > 0 else 0.0,
                flops=_flops(m, m.flop_count) if m.flop_count is not None else None,
                step_time_s=step_s,
                microbatches=m.microbatches if train else None,
                skipped_updates=m.skipped if train else None,
                wall_s=wall_s,
                step_mean_s=step_s / timed if timed else 0.0,
                step_p50_s=_pct(ds, 0.5),
                step_p90_s=_pct(ds, 0.9),
                step_max_s=ds[-1] if ds else 0.0,
                phases=phases,
                gpu_idle_s={k: v / 1e9 for k, v in m.idle_ns.items()},
            )
        return modes


def _flops(m: _ModeStats, c: FlopCount) -> Flops:
    """FLOPs per step (``c``: the mode's count), achieved FLOP/s over the steps with a
    known count, and MFU."""
    timed = m.flops - (c.per_step if m.counted is not None else 0.0)  # the FLOPs of the steps in flop_ns
    flop_s = timed / (m.flop_ns / 1e9) if m.flop_ns > 0 else 0.0
    return Flops(
        per_step=c.per_step,
        total=m.flops,
        flop_s=flop_s,
        peak_flop_s=c.peak,
        mfu=flop_s / c.peak if c.peak else None,
        dtype=c.dtype,
        device=c.device,
        source=c.source,
        count_cost_s=c.cost_s,
        counted_step=m.counted[0] if m.counted is not None else None,
        counted_step_s=m.counted[1] / 1e9 if m.counted is not None else None,
    )


def write(summary: Run | dict, path: str) -> str:
    """Write the summary as JSON; ``{rank}`` and ``{pid}`` in the path are expanded."""
    run = summary if isinstance(summary, Run) else Run.from_dict(summary)
    path = expand(path, summary.get("rank", 0) if isinstance(summary, dict) else run.rank)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(run.to_json())
    os.replace(tmp, path)
    return path


class SummaryFile:
    """``OTEL_TRAINING_SUMMARY_FILE``: checked at start (one line if it cannot be
    written, and none at the end), written at exit."""

    def __init__(self, template: str | None, rank: int | None) -> None:
        self.template = template or ""
        self.rank = rank
        self.ok = True

    def path(self) -> str:
        return expand(self.template, self.rank)

    def check(self) -> None:
        """Find out now, not after the run, that the file cannot be written. A
        missing folder is created."""
        if not self.template:
            return
        path = self.path()
        try:
            check_writable(path)
        except OSError as exc:
            self.ok = False
            self._error(exc)

    def write(self, summary: Run | dict) -> None:
        if not self.template or not self.ok:
            return
        try:
            write(summary, self.template)
        except OSError as exc:
            self._error(exc)

    def _error(self, exc: OSError) -> None:
        import sys

        reason = exc.strerror or type(exc).__name__
        print(
            f"otel-training: OTEL_TRAINING_SUMMARY_FILE={self.template!r} cannot be "
            f"written ({reason}): use a writable file path (no summary file for this run; "
            f"training continues)",
            file=sys.stderr,
            flush=True,
        )
