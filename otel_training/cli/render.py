"""Every text we print about a run, in one place: the run-end table (stderr at
exit), ``otel-training report``'s tables, the verdict and its findings, and the
step-detection self-check."""

from __future__ import annotations

import time
from statistics import median

from otel_training import semconv as sc
from otel_training.aggregate.coverage import gap_place
from otel_training.cli.finding import Finding
from otel_training.cli.verdict import diagnose
from otel_training.cli.words import plural, timing_words

BAR = 20


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _table(headers: list[str], rows: list[list[str]], right: set, indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def fmt(cells):
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(out)).rstrip()

    return [fmt(headers)] + [fmt(r) for r in rows]


def _bar(share: float) -> str:
    n = max(0, min(BAR, int(round(share * BAR))))
    return "#" * n + "." * (BAR - n)


def _ordered_phases(phases: list[dict]) -> list[dict]:
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


def render_mode(mode: str, m: dict) -> list[str]:
    rates = f"{m['throughput_sps']:,.1f} samples/s"
    if m.get("tokens_per_s"):
        rates += f", {m['tokens_per_s']:,.0f} tokens/s"
    counts = f"{plural(m['steps'], 'step')}, {plural(m['samples'], 'sample')}"
    head = f"{mode}: {counts}, {rates}, step mean {_ms(m['step_mean_s'])} ms"
    extra = [f"{k} {_ms(m.get(f'step_{k}_s'))}" for k in ("p50", "p90", "max") if m.get(f"step_{k}_s")]
    if extra:
        head += f" ({', '.join(extra)} ms)"
    rows = []
    for p in _ordered_phases(m["phases"]):
        rows.append(
            [
                "  " * p["depth"] + p["name"],
                p["parent"],
                f"{p['total_s']:.2f}",
                _ms(p["mean_s"]),
                _pct(p["share"]),
                _bar(p["share"]) if not p["depth"] else "",
            ]
        )
    lines = [head] + _table(["phase", "parent", "total s", "ms/step", "share", ""], rows, {2, 3, 4})
    if m.get("flops"):
        lines.append("  " + compute_text(m["flops"]))
    idle = m.get("gpu_idle_s") or {}
    if m.get("gpu_idle_share") is not None and m["step_time_s"]:
        parts = ", ".join(
            f"{k} {_pct(v / m['step_time_s'])}" for k, v in sorted(idle.items(), key=lambda kv: -kv[1])[:4]
        )
        lines.append(f"  GPU idle: {_pct(m['gpu_idle_share'])} of step time ({parts})")
    return lines


def render_gpus(report: dict) -> list[str]:
    gpus = report.get("gpus") or []
    if not gpus:
        if report.get("source") == "summary":
            return ["GPU utilization: not in summary files (use --prometheus for hw_gpu_utilization_ratio)"]
        return [
            "GPU utilization: no hw_gpu_utilization_ratio series for this run (no GPU, or the hardware sampler was off)"
        ]
    rows = [[g["host"], g["index"] or g["gpu"], g["model"], _pct(g["mean"]), _pct(g["min"])] for g in gpus]
    u = report["gpu_utilization"]
    return (
        ["GPU utilization (hw_gpu_utilization_ratio):"]
        + _table(["host", "gpu", "model", "mean", "min"], rows, {3, 4})
        + [f"  all {len(gpus)} GPUs: mean {_pct(u['mean'])}, lowest {_pct(u['min'])}"]
    )


def render_ranks(mode: str, rows: list[dict], phases: list[str]) -> list[str]:
    if len(rows) < 2:
        return []
    body = []
    for r in rows:
        body.append(
            [
                str(r.get("rank") if r.get("rank") is not None else "?"),
                str(r.get("host") or ""),
                f"{r['steps']:,}",
                _ms(r["step_mean_s"]),
                f"{r['throughput_sps']:,.1f}",
            ]
            + [_pct(r["phases"].get(p, 0.0)) for p in phases]
        )
    lines = [f"ranks ({mode}):"] + _table(
        ["rank", "host", "steps", "step ms", "samples/s"] + phases, body, set(range(2, 5 + len(phases)))
    )
    means = [r["step_mean_s"] for r in rows if r["step_mean_s"]]
    if means:
        slow = max(rows, key=lambda r: r["step_mean_s"])
        med = median([r["step_mean_s"] for r in rows if r is not slow] or means)
        lines.append(
            f"  spread: slowest rank {slow.get('rank')} ({slow.get('host')}) "
            f"{slow['step_mean_s'] / min(means):.2f}x the fastest, "
            f"{slow['step_mean_s'] / med:.2f}x the others' median"
        )
    return lines


def render_coverage(report: dict) -> list[str]:
    """Per rank, the share of the training loop inside steps; the self-check's findings."""
    lines = []
    ranks = report.get("coverage") or []
    for c in ranks:
        who = f"rank {c['rank']} " if len(ranks) > 1 and c.get("rank") is not None else ""
        line = (
            f"coverage: {who}{_pct(c.get('share'))} of the training loop's {c.get('loop_s', 0):.1f} s is inside steps"
            + named_text(c)
        )
        if c.get("gaps"):
            line += (
                f"; {c['outside_s']:.2f} s outside in {plural(c['gaps'], 'gap')} (largest {c['largest_gap_s']:.2f} s "
                f"{gap_place(c.get('largest_gap_after_step'))})"
            )
        lines.append(line)
    for f in report.get("self_check") or ():
        who = f" (rank {f['rank']})" if len(ranks) > 1 and f.get("rank") is not None else ""
        lines.extend(self_check_lines(f, "", who))
    return lines


def render_findings(findings: list[Finding], limit: int = 3) -> list[str]:
    """The verdict line, then each top finding with its share, detail and advice."""
    lines = [verdict_line(findings)]
    if not findings:
        return lines
    for i, f in enumerate(findings[:limit], 1):
        lines.append(
            f"  {i}. [{f.severity}] {f.title} ({_pct(f.score)} of step time)"
            if f.score
            else f"  {i}. [{f.severity}] {f.title}"
        )
        lines.append(f"     {f.detail}")
        lines.extend(f"     - {a}" for a in f.advice)
    return lines


def render(report: dict, findings: list[Finding], mode: str | None) -> str:
    fmt = "%Y-%m-%d %H:%M:%S"
    rng = report.get("range") or {}
    when = ""
    if rng.get("start") and rng.get("end"):
        when = (
            f", {time.strftime(fmt, time.localtime(rng['start']))} .. {time.strftime(fmt, time.localtime(rng['end']))}"
        )
    src = (
        plural(len(report["files"]), "summary file")
        if report["source"] == "summary"
        else f"{report['prometheus']} {report['selector']}"
    )
    lines = [f"otel-training report: run {report.get('run')} ({src}{when})"]
    timing = timing_words(report.get("timing"), (report.get("run_facts") or {}).get("device"))
    if timing:
        lines[0] += f", {timing}"
    for name, m in report["modes"].items():
        lines.append("")
        lines.extend(render_mode(name, m))
    lines.append("")
    lines.extend(render_gpus(report))
    if mode:
        rows = (report.get("ranks") or {}).get(mode) or []
        top = [
            p["name"]
            for p in sorted(report["modes"][mode]["phases"], key=lambda p: -p["share"])
            if p["parent"] == sc.SPAN_STEP
        ][:3]
        rk = render_ranks(mode, rows, top)
        if rk:
            lines.append("")
            lines.extend(rk)
    for mem in report.get("memory") or []:
        who = f"rank {mem['rank']} " if len(report["memory"]) > 1 and mem.get("rank") is not None else ""
        lines.append(f"{who}{memory_text(mem)}")
    cover = render_coverage(report)
    if cover:
        lines.append("")
        lines.extend(cover)
    from otel_training.cli.job_render import report_lines  # the goodput bar

    goodput = report_lines(report)
    if goodput:
        lines.append("")
        lines.extend(goodput)
    tel = {k: v for k, v in (report.get("telemetry") or {}).items() if v}
    if tel:
        lines.append("")
        lines.append("telemetry problems: " + ", ".join(f"{k}={v}" for k, v in tel.items()))
    lines.append("")
    lines.extend(render_findings(findings))
    return "\n".join(lines)


# -- the run-end table ------------------------------------------------------------------
def render_summary(summary: dict) -> str:
    """The run-end breakdown table(s) and a one-line verdict with advice."""
    lines = []
    for mode, m in summary["modes"].items():
        if not m["steps"]:
            continue
        rate = m.get("samples_per_s") or 0.0  # over the mode's own step time
        head = f"otel-training: {mode} — {plural(m['steps'], 'step')}"
        if m.get("microbatches", 0) > m["steps"]:
            head += f" ({plural(m['microbatches'], 'micro-batch', 'micro-batches')})"
        if m.get("skipped_updates"):
            head += f" ({plural(m['skipped_updates'], 'update')} skipped)"
        head += f", mean step {m['step_mean_s'] * 1e3:.1f} ms"
        head += f" (p90 {m['step_p90_s'] * 1e3:.1f} ms)"
        if rate:
            head += f", {rate:.0f} samples/s"
        if m.get("tokens_per_s"):
            head += f", {m['tokens_per_s']:,.0f} tokens/s"
        lines.append(head)
        if m.get("flops"):
            lines.append("  " + compute_text(m["flops"]))
        lines.append(f"  {'phase':<28}{'mean ms':>10}{'total s':>10}{'share':>8}")
        idle = m.get("gpu_idle_s") or {}
        top = [p for p in m["phases"] if p["parent"] == sc.SPAN_STEP]
        for p in top:
            label = p["name"] + ("*" if p["name"] == sc.PHASE_UNTRACKED else "")
            lines.append(f"  {label:<28}{p['mean_s'] * 1e3:>10.2f}{p['total_s']:>10.2f}{p['share'] * 100:>7.1f}%")
            for c in m["phases"]:
                if c["parent"] == p["name"]:
                    lines.append(
                        f"    {c['name']:<26}{c['mean_s'] * 1e3:>10.2f}{c['total_s']:>10.2f}{c['share'] * 100:>7.1f}%"
                    )
        if any(p["name"] == sc.PHASE_UNTRACKED for p in top):
            lines.append("  * untracked: time outside every phase (callbacks, logging, user code)")
        if idle and m["step_time_s"]:
            total_idle = sum(idle.values())
            worst = max(idle, key=lambda name: idle[name])
            lines.append(f"  GPU idle {total_idle / m['step_time_s'] * 100:.1f}% of step time (mostly during {worst})")
    if summary.get("memory"):
        lines.append("  " + memory_text(summary["memory"]))
    coverage = coverage_line(summary)
    if coverage:
        lines.append(coverage)
    for finding in summary.get("self_check") or ():
        lines.extend(self_check_lines(finding, "  "))
    tel = summary.get("telemetry") or {}
    bad = {k: v for k, v in tel.items() if v}
    if bad:
        lines.append("  telemetry problems: " + ", ".join(f"{k}={v}" for k, v in bad.items()))
    found = diagnose(summary)
    if found:
        lines.extend(verdict_lines(found[0]))
    for f in found[1:]:
        if f.kind == "memory_creep":
            lines.append(f"{f.title}: {f.detail}")
            lines.extend(f"  - {a}" for a in f.advice[:2])
    from otel_training.cli.job_render import summary_lines  # the goodput bar

    lines.extend(summary_lines(summary))
    return "\n".join(lines)


def coverage_line(summary: dict) -> str:
    """``coverage: 99.2% of the training loop's 12.3 s is inside steps; ...``."""
    cov = summary.get("coverage")
    if not cov or not cov.get("loop_s"):
        return ""
    line = f"  coverage: {cov['share'] * 100:.1f}% of the training loop's {cov['loop_s']:.1f} s is inside steps"
    line += named_text(cov)
    if cov.get("gaps"):
        line += (
            f"; outside: {cov['outside_s']:.2f} s in {plural(cov['gaps'], 'gap')}"
            f" (largest {cov['largest_gap_s']:.2f} s {gap_place(cov['largest_gap_after_step'])})"
        )
    if cov.get("before_first_step_s"):
        line += f"; start-up {cov['before_first_step_s']:.1f} s before the first step"
    return line


# -- findings -----------------------------------------------------------------------------
def verdict_line(findings: list[Finding]) -> str:
    """``verdict: <title>: <detail>`` for the first finding."""
    return "verdict: " + (findings[0].line() if findings else "no data")


def verdict_lines(finding: Finding, advice: int = 3) -> list[str]:
    """The run-end table's verdict: the top finding and its first advice."""
    detail = finding.detail
    return [f"verdict: {finding.title}" + (f" ({detail})" if detail else "")] + [
        f"  - {a}" for a in finding.advice[:advice]
    ]


def named_text(cov: dict) -> str:
    """``, 12.0% in named phases between steps (checkpoint 2 × 0.41 s, save 0.30 s)``:
    the user's ``phase(name)`` with no step open, by name (empty without any)."""
    named = cov.get("named") or []
    if not named:
        return ""
    loop = cov.get("loop_s") or 0.0
    share = f"{cov.get('named_s', 0.0) / loop * 100:.1f}% " if loop > 0 else ""
    parts = [
        f"{n['name']} {n['count']} × {n['total_s'] / n['count']:.2f} s"
        if n["count"] > 1
        else f"{n['name']} {n['total_s']:.2f} s"
        for n in named[:6]
    ]
    more = f", {len(named) - 6} more" if len(named) > 6 else ""
    return f", {share}in named phases between steps ({', '.join(parts)}{more})"


def self_check_lines(finding: dict, indent: str = "", who: str = "") -> list[str]:
    """A self-check finding (step detection in doubt) and its fix, for tables."""
    return [f"{indent}step detection in doubt{who}: {finding['cause']}", f"{indent}  fix: {finding['fix']}"]


def self_check_line(finding: dict) -> str:
    """The one line printed at exit for a self-check finding."""
    return f"otel-training: step detection in doubt: {finding['cause']}; fix: {finding['fix']}"


# -- throughput, FLOPs and memory ---------------------------------------------------------
def _si(x: float, unit: str) -> str:
    """``1.51 GFLOP``, ``989 TFLOP/s``."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for factor, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n:.0f} B"


def compute_text(f: dict) -> str:
    """``compute: 1.51 GFLOP per step, 33.4 GFLOP/s, MFU 41.0% of ...``."""
    text = f"compute: {_si(f['per_step'], 'FLOP')} per step"
    if f.get("flop_s"):
        text += f", {_si(f['flop_s'], 'FLOP/s')}"
    if f.get("mfu") is not None:
        text += f", MFU {100 * f['mfu']:.1f}%"
        if f.get("peak_flop_s"):
            where = ", ".join(str(x) for x in (f.get("dtype"), f.get("device")) if x)
            text += f" of {_si(f['peak_flop_s'], 'FLOP/s')}" + (f" ({where})" if where else "")
    else:
        text += " (no peak known: OTEL_TRAINING_PEAK_FLOPS gives MFU)"
    if f.get("source") == "measured":
        counted = f.get("counted_step")
        if counted is not None:
            text += f"; counted once on train step {counted}"
            if f.get("counted_step_s") is not None:
                text += f" ({1e3 * f['counted_step_s']:.0f} ms"
                if f.get("count_cost_s") is not None:
                    text += f", +{1e3 * f['count_cost_s']:.0f} ms"
                text += "), left out of the step times and throughput"
        elif f.get("count_cost_s") is not None:
            text += f"; counted once, +{1e3 * f['count_cost_s']:.0f} ms"
    return text


def memory_text(mem: dict) -> str:
    """``memory: peak 12.3 GiB allocated ...`` (CUDA) or ``memory: RSS ...`` (CPU)."""
    if mem.get("kind") == "cuda":
        text = (
            f"memory: peak {_bytes(mem.get('peak_allocated_bytes'))} allocated, "
            f"{_bytes(mem.get('peak_reserved_bytes'))} reserved per step; "
            f"{_bytes(mem.get('last_bytes'))} allocated at the last step end"
        )
        if mem.get("device"):
            text += f" ({mem['device']})"
        return text + f"; {mem.get('alloc_retries', 0)} allocator retries, {mem.get('ooms', 0)} OOMs"
    text = f"memory: RSS {_bytes(mem.get('last_bytes'))} at the last step end"
    return text + (f" ({_bytes(mem['first_bytes'])} at the first)" if mem.get("first_bytes") else "")
