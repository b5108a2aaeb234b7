"""What a profile caught: its trace file written and its operators read (a worker
thread), then each operator tied to the phase it ran in (when the summary is made).

Operators are torch.profiler's ``FunctionEvent``s. Their times count from the
profiler's own start; the capture's anchor (``record/profile_capture.py``: a
``record_function`` range entered with our clock read inside it) maps them onto the
steps' clock (``perf_counter_ns``), so an operator's start falls in a phase of a
captured step's record. On CUDA the time ranked is the kernels' (an operator's
kernels, at the phase where the operator launched them); on the CPU, the operator's
self time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from otel_training import semconv as sc
from otel_training.record.profile_capture import ANCHOR, Capture

MAX_OPS = 200_000  # operators kept per profile (beyond: the rest are not ranked)
TOP = 10  # operators listed per profile
# Names torch gives a compiled graph's call: its operators are inside it, fused.
_COMPILED = ("Torch-Compiled Region", "CompiledFunction", "CompiledFxGraph", "## Call CompiledFxGraph")
BETWEEN = "between steps"  # an operator of the capture outside every captured step


class Op(NamedTuple):
    name: str  # the operator (CPU) or the kernel (CUDA)
    start_ns: int  # on the steps' clock (perf_counter_ns): where the operator began
    ns: int  # self time (CPU) or kernel time (CUDA)


class Caught(NamedTuple):
    """A profile's operators, read once (``read``)."""

    ops: tuple[Op, ...]
    device: str  # "cuda" (kernels ranked) or "cpu" (operators' self time)
    compiled: bool  # torch.compile'd regions were in it
    events: int  # operators and kernels in the trace


class PhaseSpan(NamedTuple):
    """A phase of a captured step, on the steps' clock (``depth`` 0: top level)."""

    name: str
    start_ns: int
    end_ns: int
    depth: int


class StepSpan(NamedTuple):
    mode: str
    number: int
    start_ns: int
    end_ns: int
    phases: tuple[PhaseSpan, ...]


class TopOp(NamedTuple):
    phase: str
    name: str
    s: float
    share: float  # of every operator's time in the profile
    phase_share: float  # of the operators' time in this phase


def _us(value: Any) -> float:
    return float(value or 0.0)


def read(capture: Capture) -> Caught:
    """Write ``capture``'s trace file (``capture.path``) and read its operators; the
    profiler object is dropped after (its memory is the capture's largest)."""
    prof = capture.profiler
    capture.profiler = None
    if capture.path:
        prof.export_chrome_trace(capture.path)
    events = list(prof.events() or ())
    offset_ns = 0
    for e in events:
        if e.name == ANCHOR:
            offset_ns = capture.anchor_ns - int(_us(e.time_range.start) * 1000)
            break
    cuda = any(_kernels(e) for e in events)
    compiled = any(any(mark in e.name for mark in _COMPILED) for e in events)
    ops: list[Op] = []
    for e in events:
        if e.name == ANCHOR or getattr(e, "is_async", False):
            continue
        start = int(_us(e.time_range.start) * 1000) + offset_ns
        if cuda:
            for k in _kernels(e):
                ops.append(Op(str(k.name), start, int(_us(k.duration) * 1000)))
        elif _is_cpu(e):
            ns = int(_us(e.self_cpu_time_total) * 1000)
            if ns > 0:
                ops.append(Op(e.name, start, ns))
        if len(ops) >= MAX_OPS:
            break
    return Caught(tuple(ops), "cuda" if cuda else "cpu", compiled, len(events))


def _kernels(event: Any) -> Sequence[Any]:
    return getattr(event, "kernels", None) or ()


def _is_cpu(event: Any) -> bool:
    kind = getattr(event, "device_type", None)
    return kind is None or getattr(kind, "name", str(kind)).upper().endswith("CPU")


def step_span(record: Any) -> StepSpan:
    """A captured step's phases on the steps' clock (a ``StepRecord``: its host marks,
    where the operators were launched)."""
    host = record.host
    layout = record.layout
    depth: list[int] = []
    phases: list[PhaseSpan] = []
    for p in layout.phases:
        d = 0 if p.parent < 0 else depth[p.parent] + 1
        depth.append(d)
        phases.append(PhaseSpan(p.name, host[p.start], host[p.end], d))
    return StepSpan(record.mode, record.number, host[0], host[-1], tuple(phases))


def phase_at(steps: Sequence[StepSpan], t: int) -> str:
    """The innermost phase of the captured steps holding time ``t``."""
    for step in steps:
        if step.start_ns <= t < step.end_ns:
            best, depth = sc.PHASE_UNTRACKED, -1
            for p in step.phases:
                if p.start_ns <= t < p.end_ns and p.depth > depth:
                    best, depth = p.name, p.depth
            return best
    return BETWEEN


def top_ops(caught: Caught, steps: Sequence[StepSpan], limit: int = TOP) -> tuple[tuple[TopOp, ...], dict[str, float]]:
    """The operators with the most time, each with the phase it ran in; and the
    operators' seconds per phase."""
    by_key: dict[tuple[str, str], int] = {}
    per_phase: dict[str, int] = {}
    spans = sorted(steps, key=lambda s: s.start_ns)
    for op in caught.ops:
        phase = phase_at(spans, op.start_ns)
        key = (phase, op.name)
        by_key[key] = by_key.get(key, 0) + op.ns
        per_phase[phase] = per_phase.get(phase, 0) + op.ns
    total = sum(per_phase.values()) or 1
    ranked = sorted(by_key.items(), key=lambda kv: -kv[1])[:limit]
    top = tuple(TopOp(phase, name, ns / 1e9, ns / total, ns / (per_phase[phase] or 1)) for (phase, name), ns in ranked)
    return top, {k: v / 1e9 for k, v in sorted(per_phase.items(), key=lambda kv: -kv[1])}
