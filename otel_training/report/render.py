"""Terminal tables for a report (see ``otel_training.report.sources`` for its shape)."""

from __future__ import annotations

import time
from statistics import median
from typing import List, Optional

from otel_training import semconv as sc
from otel_training.verdict import Finding

BAR = 20


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _table(headers: List[str], rows: List[List[str]], right: set, indent: str = "  ") -> List[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def fmt(cells):
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(out)).rstrip()

    return [fmt(headers)] + [fmt(r) for r in rows]


def _bar(share: float) -> str:
    n = max(0, min(BAR, int(round(share * BAR))))
    return "#" * n + "." * (BAR - n)


def _ordered_phases(phases: List[dict]) -> List[dict]:
    """Top-level phases by share, each followed by its children (indented)."""
    top = sorted((p for p in phases if p["parent"] == sc.SPAN_STEP), key=lambda p: -p["share"])
    out, seen = [], set()

    def add(p, depth):
        if id(p) in seen or depth > 4:
            return
        seen.add(id(p))
        out.append(dict(p, depth=depth))
        for c in sorted((c for c in phases if c["parent"] == p["name"]), key=lambda c: -c["share"]):
            add(c, depth + 1)

    for p in top:
        add(p, 0)
    out.extend(dict(p, depth=1) for p in phases if id(p) not in seen)
    return out


def render_mode(mode: str, m: dict) -> List[str]:
    head = (f"{mode}: {m['steps']:,} steps, {m['samples']:,} samples, "
            f"{m['throughput_sps']:,.1f} samples/s, step mean {_ms(m['step_mean_s'])} ms")
    extra = [f"{k} {_ms(m.get(f'step_{k}_s'))}" for k in ("p50", "p90", "max") if m.get(f"step_{k}_s")]
    if extra:
        head += f" ({', '.join(extra)} ms)"
    rows = []
    for p in _ordered_phases(m["phases"]):
        rows.append(["  " * p["depth"] + p["name"], p["parent"], f"{p['total_s']:.2f}",
                     _ms(p["mean_s"]), _pct(p["share"]), _bar(p["share"]) if not p["depth"] else ""])
    lines = [head] + _table(["phase", "parent", "total s", "ms/step", "share", ""], rows, {2, 3, 4})
    idle = m.get("gpu_idle_s") or {}
    if m.get("gpu_idle_share") is not None and m["step_time_s"]:
        parts = ", ".join(f"{k} {_pct(v / m['step_time_s'])}"
                          for k, v in sorted(idle.items(), key=lambda kv: -kv[1])[:4])
        lines.append(f"  GPU idle: {_pct(m['gpu_idle_share'])} of step time ({parts})")
    return lines


def render_gpus(report: dict) -> List[str]:
    gpus = report.get("gpus") or []
    if not gpus:
        if report.get("source") == "summary":
            return ["GPU utilization: not in summary files (use --prometheus for hw_gpu_utilization_ratio)"]
        return ["GPU utilization: no hw_gpu_utilization_ratio series for this run (no GPU, "
                "or the hardware sampler was off)"]
    rows = [[g["host"], g["index"] or g["gpu"], g["model"], _pct(g["mean"]), _pct(g["min"])]
            for g in gpus]
    u = report["gpu_utilization"]
    return (["GPU utilization (hw_gpu_utilization_ratio):"]
            + _table(["host", "gpu", "model", "mean", "min"], rows, {3, 4})
            + [f"  all {len(gpus)} GPUs: mean {_pct(u['mean'])}, lowest {_pct(u['min'])}"])


def render_ranks(mode: str, rows: List[dict], phases: List[str]) -> List[str]:
    if len(rows) < 2:
        return []
    body = []
    for r in rows:
        body.append([str(r.get("rank") if r.get("rank") is not None else "?"), str(r.get("host") or ""),
                     f"{r['steps']:,}", _ms(r["step_mean_s"]), f"{r['throughput_sps']:,.1f}"]
                    + [_pct(r["phases"].get(p, 0.0)) for p in phases])
    lines = [f"ranks ({mode}):"] + _table(
        ["rank", "host", "steps", "step ms", "samples/s"] + phases, body,
        set(range(2, 5 + len(phases))))
    means = [r["step_mean_s"] for r in rows if r["step_mean_s"]]
    if means:
        slow = max(rows, key=lambda r: r["step_mean_s"])
        med = median([r["step_mean_s"] for r in rows if r is not slow] or means)
        lines.append(f"  spread: slowest rank {slow.get('rank')} ({slow.get('host')}) "
                     f"{slow['step_mean_s'] / min(means):.2f}x the fastest, "
                     f"{slow['step_mean_s'] / med:.2f}x the others' median")
    return lines


def render_coverage(report: dict) -> List[str]:
    """Per rank, the share of the training loop inside steps; the self-check's findings."""
    lines = []
    ranks = report.get("coverage") or []
    for c in ranks:
        who = f"rank {c['rank']} " if len(ranks) > 1 and c.get("rank") is not None else ""
        line = (f"coverage: {who}{_pct(c.get('share'))} of the training loop's {c.get('loop_s', 0):.1f} s "
                f"is inside steps")
        if c.get("gaps"):
            line += (f"; {c['outside_s']:.2f} s outside in {c['gaps']} gaps (largest {c['largest_gap_s']:.2f} s "
                     f"after step {c.get('largest_gap_after_step')})")
        lines.append(line)
    for f in report.get("self_check") or ():
        who = f" (rank {f['rank']})" if len(ranks) > 1 and f.get("rank") is not None else ""
        lines.append(f"step detection in doubt{who}: {f['cause']}")
        lines.append(f"  fix: {f['fix']}")
    return lines


def render_findings(findings: List[Finding], limit: int = 3) -> List[str]:
    if not findings:
        return ["verdict: no data"]
    lines = [f"verdict: {findings[0].line()}"]
    for i, f in enumerate(findings[:limit], 1):
        lines.append(f"  {i}. [{f.severity}] {f.title} ({_pct(f.score)} of step time)"
                     if f.score else f"  {i}. [{f.severity}] {f.title}")
        lines.append(f"     {f.detail}")
        lines.extend(f"     - {a}" for a in f.advice)
    return lines


def render(report: dict, findings: List[Finding], mode: Optional[str]) -> str:
    fmt = "%Y-%m-%d %H:%M:%S"
    rng = report.get("range") or {}
    when = ""
    if rng.get("start") and rng.get("end"):
        when = (f", {time.strftime(fmt, time.localtime(rng['start']))} .. "
                f"{time.strftime(fmt, time.localtime(rng['end']))}")
    src = (f"{len(report['files'])} summary file(s)" if report["source"] == "summary"
           else f"{report['prometheus']} {report['selector']}")
    lines = [f"otel-training report: run {report.get('run')} ({src}{when})"]
    if report.get("timing"):
        lines[0] += f", timing {report['timing']}"
    for name, m in report["modes"].items():
        lines.append("")
        lines.extend(render_mode(name, m))
    lines.append("")
    lines.extend(render_gpus(report))
    if mode:
        rows = (report.get("ranks") or {}).get(mode) or []
        top = [p["name"] for p in sorted(report["modes"][mode]["phases"], key=lambda p: -p["share"])
               if p["parent"] == sc.SPAN_STEP][:3]
        rk = render_ranks(mode, rows, top)
        if rk:
            lines.append("")
            lines.extend(rk)
    cover = render_coverage(report)
    if cover:
        lines.append("")
        lines.extend(cover)
    tel = {k: v for k, v in (report.get("telemetry") or {}).items() if v}
    if tel:
        lines.append("")
        lines.append("telemetry problems: " + ", ".join(f"{k}={v}" for k, v in tel.items()))
    lines.append("")
    lines.extend(render_findings(findings))
    return "\n".join(lines)
