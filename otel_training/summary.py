"""Run-end summary: per-mode phase totals, the breakdown table and the verdict."""

from __future__ import annotations

import json
import os
import time
from array import array
from itertools import repeat
from operator import truediv
from typing import Dict, List, Optional, Tuple

from otel_training import semconv as sc

SCHEMA = "otel-training/summary/v1"
_MAX_DURATIONS = 200_000  # per mode, for percentiles; older ones are thinned out


class _ModeStats:
    __slots__ = ("steps", "samples", "microbatches", "skipped", "step_ns", "phases", "idle_ns", "durations",
                 "first_start", "last_end")

    def __init__(self) -> None:
        self.steps = 0
        self.samples = 0
        self.microbatches = 0
        self.skipped = 0
        self.step_ns = 0
        self.phases: Dict[Tuple[str, str], list] = {}  # (name, parent) -> [total ns, count]
        self.idle_ns: Dict[str, int] = {}
        self.durations = array("d")
        self.first_start: Optional[int] = None
        self.last_end: Optional[int] = None


class RunSummary:
    """Aggregates finished steps (on the pipeline thread)."""

    def __init__(self, resource_info: dict, timing: str) -> None:
        self.info = dict(resource_info)
        self.timing = timing
        self.started_at = time.time()
        self.modes: Dict[str, _ModeStats] = {}

    def _mode(self, mode: str) -> _ModeStats:
        m = self.modes.get(mode)
        if m is None:
            m = self.modes[mode] = _ModeStats()
        return m

    def phase_totals(self, mode: str, key: Tuple[str, str]) -> list:
        """The live ``[total ns, steps]`` of phase ``key`` (name, parent) in ``mode``."""
        phases = self._mode(mode).phases
        slot = phases.get(key)
        if slot is None:
            slot = phases[key] = [0, 0]
        return slot

    def add_step(self, mode: str, start_ns: int, end_ns: int, idle_ns: Optional[Dict[str, int]],
                 batch_size: Optional[int], microbatches: int = 0, skipped: int = 0) -> None:
        """One step's totals; its phases go to their ``phase_totals`` directly."""
        self.add_steps(mode, start_ns, end_ns, [end_ns - start_ns], batch_size or 0, microbatches)
        m = self._mode(mode)
        if skipped:
            m.skipped += 1
        if idle_ns:
            for name, ns in idle_ns.items():
                m.idle_ns[name] = m.idle_ns.get(name, 0) + ns

    def add_steps(self, mode: str, first_start: int, last_end: int, step_ns: List[int], samples: int,
                  microbatches: int = 0) -> None:
        """Steps in bulk (no GPU idle time): ``step_ns`` their durations,
        ``first_start``/``last_end`` their span (steps may come in out of order),
        ``samples`` their batch sizes' sum, ``microbatches`` theirs."""
        m = self._mode(mode)
        m.steps += len(step_ns)
        m.samples += samples
        m.microbatches += microbatches
        m.step_ns += sum(step_ns)
        if m.first_start is None or first_start < m.first_start:
            m.first_start = first_start
        if m.last_end is None or last_end > m.last_end:
            m.last_end = last_end
        m.durations.extend(map(truediv, step_ns, repeat(1e9)))
        while len(m.durations) > _MAX_DURATIONS:
            m.durations = m.durations[::2]

    def to_dict(self, telemetry: Optional[dict] = None) -> dict:
        modes = {}
        for mode, m in self.modes.items():
            step_s = m.step_ns / 1e9
            ds = sorted(m.durations)
            pct = (lambda q: ds[min(len(ds) - 1, int(q * len(ds)))] if ds else 0.0)
            phases = []
            for (name, parent), (ns, count) in sorted(m.phases.items(), key=lambda kv: -kv[1][0]):
                phases.append({
                    "name": name, "parent": parent, "total_s": ns / 1e9,
                    "mean_s": ns / 1e9 / m.steps if m.steps else 0.0, "count": count,
                    "share": (ns / m.step_ns) if m.step_ns else 0.0,
                })
            modes[mode] = {
                "steps": m.steps, "samples": m.samples, "step_time_s": step_s,
                **({"microbatches": m.microbatches, "skipped_updates": m.skipped} if mode == sc.MODE_TRAIN else {}),
                "wall_s": ((m.last_end or 0) - (m.first_start or 0)) / 1e9,
                "step_mean_s": step_s / m.steps if m.steps else 0.0,
                "step_p50_s": pct(0.5), "step_p90_s": pct(0.9), "step_max_s": ds[-1] if ds else 0.0,
                "phases": phases,
                "gpu_idle_s": {k: v / 1e9 for k, v in m.idle_ns.items()},
            }
        out = {"schema": SCHEMA, **self.info, "timing": self.timing, "started_at": self.started_at,
               "ended_at": time.time(), "modes": modes,
               "telemetry": telemetry or {"spans_dropped": 0, "steps_dropped": 0, "export_failures": 0, "errors": 0}}
        return out


def findings(summary: dict) -> list:
    """The verdict module's findings, most important first (empty if unavailable)."""
    try:
        from otel_training.verdict import diagnose
    except ImportError:  # pragma: no cover - verdict ships with the package
        return []
    return list(diagnose(summary))


def render(summary: dict) -> str:
    """The run-end breakdown table(s) and a one-line verdict with advice."""
    lines = []
    for mode, m in summary["modes"].items():
        if not m["steps"]:
            continue
        rate = m["samples"] / m["wall_s"] if m["wall_s"] and m["samples"] else 0.0
        head = f"otel-training: {mode} — {m['steps']} steps"
        if m.get("microbatches", 0) > m["steps"]:
            head += f" ({m['microbatches']} micro-batches)"
        if m.get("skipped_updates"):
            head += f" ({m['skipped_updates']} updates skipped)"
        head += f", mean step {m['step_mean_s'] * 1e3:.1f} ms"
        head += f" (p90 {m['step_p90_s'] * 1e3:.1f} ms)"
        if rate:
            head += f", {rate:.0f} samples/s"
        lines.append(head)
        lines.append(f"  {'phase':<28}{'mean ms':>10}{'total s':>10}{'share':>8}")
        idle = m.get("gpu_idle_s") or {}
        top = [p for p in m["phases"] if p["parent"] == sc.SPAN_STEP]
        for p in top:
            label = p["name"] + ("*" if p["name"] == sc.PHASE_UNTRACKED else "")
            lines.append(f"  {label:<28}{p['mean_s'] * 1e3:>10.2f}{p['total_s']:>10.2f}{p['share'] * 100:>7.1f}%")
            for c in m["phases"]:
                if c["parent"] == p["name"]:
                    lines.append(f"    {c['name']:<26}{c['mean_s'] * 1e3:>10.2f}{c['total_s']:>10.2f}"
                                 f"{c['share'] * 100:>7.1f}%")
        if any(p["name"] == sc.PHASE_UNTRACKED for p in top):
            lines.append("  * untracked: time outside every phase (callbacks, logging, user code)")
        if idle and m["step_time_s"]:
            total_idle = sum(idle.values())
            worst = max(idle, key=idle.get)
            lines.append(f"  GPU idle {total_idle / m['step_time_s'] * 100:.1f}% of step time"
                         f" (mostly during {worst})")
    coverage = coverage_line(summary)
    if coverage:
        lines.append(coverage)
    for finding in summary.get("self_check") or ():
        lines.append(f"  step detection in doubt: {finding['cause']}")
        lines.append(f"    fix: {finding['fix']}")
    tel = summary.get("telemetry") or {}
    bad = {k: v for k, v in tel.items() if v}
    if bad:
        lines.append("  telemetry problems: " + ", ".join(f"{k}={v}" for k, v in bad.items()))
    found = findings(summary)
    if found:
        f = found[0]
        detail = getattr(f, "detail", "")
        lines.append(f"verdict: {getattr(f, 'title', f)}" + (f" ({detail})" if detail else ""))
        lines += [f"  - {a}" for a in (getattr(f, "advice", None) or [])[:3]]
    return "\n".join(lines)


def coverage_line(summary: dict) -> str:
    """``coverage: 99.2% of the training loop's 12.3 s is inside steps; ...``."""
    cov = summary.get("coverage")
    if not cov or not cov.get("loop_s"):
        return ""
    line = f"  coverage: {cov['share'] * 100:.1f}% of the training loop's {cov['loop_s']:.1f} s is inside steps"
    if cov.get("gaps"):
        line += (f"; outside: {cov['outside_s']:.2f} s in {cov['gaps']} gap{'s' if cov['gaps'] > 1 else ''}"
                 f" (largest {cov['largest_gap_s']:.2f} s after step {cov['largest_gap_after_step']})")
    if cov.get("before_first_step_s"):
        line += f"; start-up {cov['before_first_step_s']:.1f} s before the first step"
    return line


def write(summary: dict, path: str) -> str:
    """Write the summary as JSON; ``{rank}`` and ``{pid}`` in the path are expanded."""
    path = path.replace("{rank}", str(summary.get("rank", 0))).replace("{pid}", str(os.getpid()))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    os.replace(tmp, path)
    return path
