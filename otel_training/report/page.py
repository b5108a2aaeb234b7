"""``report --html`` / ``compare --html`` / ``demo --html``: one self-contained HTML file.

Everything is inlined -- uPlot (``assets/uPlot.iife.min.js``, MIT, see
``assets/README.md``), its stylesheet, the page's script and the data as JSON --
and a Content-Security-Policy of ``default-src 'none'`` keeps the page from
loading anything: it works offline, from ``file://``. The charts are specs made
by :mod:`otel_training.report.charts`; the text is the terminal report's.
"""

from __future__ import annotations

import html
import json
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources

from otel_training.diagnosis.finding import Finding
from otel_training.diagnosis.formatting import ms, share_pct
from otel_training.diagnosis.goodput_text import job_html  # the goodput bar
from otel_training.diagnosis.words import plural, timing_words
from otel_training.report.charts import Colors, compare_charts, run_charts
from otel_training.report.comparison import Comparison
from otel_training.report.model import SOURCE_SUMMARY, Report, TimeRange
from otel_training.report.series import mode_names, require
from otel_training.version import __version__

_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"


def _asset(name: str) -> str:
    return resources.files("otel_training.report").joinpath("assets", name).read_text(encoding="utf-8")


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _when(rng: TimeRange) -> str:
    if not rng.start:
        return ""
    fmt = "%Y-%m-%d %H:%M:%S"
    return f"{time.strftime(fmt, time.localtime(rng.start))} .. {time.strftime(fmt, time.localtime(rng.end))}"


def _source(report: Report) -> str:
    if report.source == SOURCE_SUMMARY:
        files = report.files
        return f"{plural(len(files), 'summary file')}: " + ", ".join(os.path.basename(f) for f in files[:8])
    return f"Prometheus {report.prometheus} {report.selector}"


def _cards(report: Report) -> str:
    out = []
    for mode in mode_names(report):
        m = report.modes[mode]
        items = [
            (f"{m.steps:,}", f"{mode} step" + ("" if m.steps == 1 else "s")),
            (ms(m.step_mean_s, unit=True), "mean step"),
            (ms(m.step_p50_s, unit=True) if m.step_p50_s else "-", "p50 step"),
            (ms(m.step_p90_s, unit=True) if m.step_p90_s else "-", "p90 step"),
            (f"{m.samples_per_s:,.1f}", "samples/s"),
        ]
        if m.gpu_idle_share is not None:
            items.append((share_pct(m.gpu_idle_share), "GPU idle"))
        out.append(
            '<div class="cards">'
            + "".join(f"<div class=card><b>{_e(v)}</b><span>{_e(k)}</span></div>" for v, k in items)
            + "</div>"
        )
    gpu = report.gpu_utilization
    if gpu:
        out.append(f'<p class="meta">GPU utilization: mean {share_pct(gpu.mean)}, lowest {share_pct(gpu.min)}</p>')
    from otel_training.report.text import render_coverage

    # coverage, with the named time between steps (a checkpoint between epochs)
    out.extend(f'<p class="meta">{_e(line)}</p>' for line in render_coverage(replace(report, self_check=())))
    return "".join(out)


def _findings(findings: Sequence[Finding]) -> str:
    if not findings:
        return ""
    items = []
    for f in findings[:6]:
        share = f" ({share_pct(f.score)} of step time)" if f.score else ""
        advice = "".join(f"<li>{_e(a)}</li>" for a in f.advice)
        items.append(
            f'<li><span class="sev {_e(f.severity)}">{_e(f.severity)}</span><b>{_e(f.title)}</b>{_e(share)}'
            f"<p>{_e(f.detail)}</p><ul>{advice}</ul></li>"
        )
    return '<ol class="findings">' + "".join(items) + "</ol>"


def _profiles(report: Report) -> str:
    """Each profile: trigger, steps, time against the median, top operators, file."""
    rows = []
    for rank, p in report.profile_list():
        steps = ", ".join(f"{s.mode} {s.step}" for s in p.steps) or "none"
        ratio = max((s.ratio for s in p.steps if s.ratio is not None), default=None)
        against = "" if ratio is None else f"{ratio:.1f}x" + (" (slow)" if p.captured_slow else "")
        why = p.trigger + (
            f" (step {p.trigger_step}, {p.ratio:.1f}x)" if p.trigger_step is not None and p.ratio else ""
        )
        tops = "".join(
            f"<li>{_e(o.phase)}: {o.phase_share * 100:.0f}% <code>{_e(o.name)}</code></li>" for o in p.top[:5]
        )
        detail = f"<ul>{tops}</ul>" if tops else _e(p.error or "")
        if p.note:
            detail += f"<p>{_e(p.note)}</p>"
        rows.append(
            f"<tr><td>{_e('' if rank is None else rank)}</td><td>{_e(why)}</td><td>{_e(steps)}</td>"
            f"<td>{_e(against)}</td><td>{detail}</td><td><code>{_e(p.file or '')}</code></td></tr>"
        )
    if not rows:
        return ""
    head = "<tr><th>rank</th><th>trigger</th><th>steps</th><th>vs median</th><th>top operators</th><th>file</th></tr>"
    return f'<h3>Profiles</h3><table class="profiles">{head}{"".join(rows)}</table>'


def _run_section(report: Report, charts: list[dict], title: str) -> str:
    from otel_training.report.text import render

    findings = report.findings or ()
    verdict = f"{findings[0].title}: {findings[0].detail}" if findings else "no data"
    meta = " · ".join(
        x
        for x in (
            f"run {report.run}",
            _source(report),
            _when(report.range),
            timing_words(report.timing, report.run_facts.device if report.run_facts is not None else None),
            f"{report.world_size} ranks" if (report.world_size or 1) > 1 else "",
        )
        if x
    )
    blocks = "".join(f'<div class="chart" data-chart="{_e(c["id"])}"></div>' for c in charts)
    text = render(report, findings, report.mode)
    return (
        f"<section><h2>{_e(title)}</h2><p class=meta>{_e(meta)}</p>"
        f'<div class="verdict"><b>verdict:</b> {_e(verdict)}</div>{_cards(report)}{job_html(report.jobs())}'
        f"<h3>Findings and advice</h3>{_findings(findings)}{_profiles(report)}"
        f'<h3>Charts</h3><div class="charts">{blocks}</div>'
        f"<details><summary>The terminal report</summary><pre>{_e(text)}</pre></details></section>"
    )


def _compare_section(c: Comparison, charts: list[dict]) -> str:
    s = c.step
    cls = c.result.replace(" ", "-")
    per = s.per
    delta = share_pct(s.delta_rel or 0, sign=True)
    head = f"{c.result}: time per {per} {ms(s.a, unit=True)} → {ms(s.b, unit=True)} ({delta})"
    moved = c.changed()
    if moved is not None:
        head += f"; {moved.name} changed most ({moved.delta * 1e3:+.1f} ms per step)"
    noise = "unknown" if s.noise is None else f"±{share_pct(s.noise / s.a)}"
    rows = [
        f"<tr><td>time per {per}</td><td>{ms(s.a, unit=True)}</td><td>{ms(s.b, unit=True)}</td>"
        f"<td>{s.delta * 1e3:+.1f} ms</td><td></td><td></td><td class='{cls}'>{_e(s.change)}</td></tr>"
    ]
    t = c.throughput
    rows.append(
        f"<tr><td>throughput (samples/s)</td><td>{t.a:,.1f}</td><td>{t.b:,.1f}</td>"
        f"<td>{t.delta:+,.1f}</td><td></td><td></td><td></td></tr>"
    )
    for p in c.phases:
        change = "" if p.change == "inconclusive" else p.change
        rows.append(
            f"<tr><td>{_e(p.name)}</td><td>{ms(p.a, unit=True)}</td><td>{ms(p.b, unit=True)}</td>"
            f"<td>{p.delta * 1e3:+.1f} ms</td>"
            f"<td>{share_pct(p.share_a)}</td><td>{share_pct(p.share_b)}</td>"
            f"<td class='{change}'>{_e(change)}</td></tr>"
        )
    verdicts = "".join(
        f"<li><b>{k.upper()}:</b> {_e(v.title + ': ' + v.detail) if v else 'no data'}</li>"
        for k, v in (("a", c.verdict.a), ("b", c.verdict.b))
    )
    blocks = "".join(f'<div class="chart" data-chart="{_e(ch["id"])}"></div>' for ch in charts)
    return (
        f'<section><h2>A vs B ({_e(c.mode)} steps)</h2><div class="verdict {cls}"><b>{_e(head)}</b><br>'
        f"noise {noise}, threshold ±{share_pct(s.threshold / s.a)} ({_e(c.noise_model)})</div>"
        "<table><tr><th></th><th>A</th><th>B</th><th>delta</th><th>A share</th><th>B share</th><th></th></tr>"
        + "".join(rows)
        + f"</table><h3>Verdicts</h3><ul>{verdicts}</ul><div class=charts>{blocks}</div></section>"
    )


def build_html(reports: Sequence[Report], comparison: Comparison | None = None) -> str:
    """The page for one run, or for two side by side (with ``comparison``)."""
    for r in reports:
        require(r)
    colors = Colors()
    charts: list[dict] = []
    sections = []
    if len(reports) == 1:
        own = run_charts(reports[0], colors)
        charts += own
        body = _run_section(reports[0], own, "Run")
        title = f"otel-training report: run {reports[0].run}"
    else:
        a, b = reports
        cmp_charts = compare_charts(a, b, colors) if comparison else []
        charts += cmp_charts
        for label, r in (("A", a), ("B", b)):
            own = run_charts(r, colors, prefix=label.lower() + "-")
            charts += own
            sections.append(_run_section(r, own, f"Run {label}"))
        body = (_compare_section(comparison, cmp_charts) if comparison else "") + (
            '<div class="side">' + "".join(sections) + "</div>"
        )
        title = f"otel-training compare: {a.run} vs {b.run}"
    data = json.dumps({"charts": {c["id"]: c for c in charts}}, separators=(",", ":"), allow_nan=False)
    data = data.replace("</", "<\\/")  # never closes the script element
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f'<meta name=viewport content="width=device-width, initial-scale=1"><title>{_e(title)}</title>'
        f"<style>{_asset('uPlot.min.css')}\n{_asset('report.css')}</style></head>\n"
        f"<body><main><h1>{_e(title)}</h1>{body}"
        f"<footer>otel-training {_e(__version__)} · charts drawn with uPlot 1.6.32 (MIT) · "
        "this file loads nothing from the network</footer></main>\n"
        f'<script type="application/json" id="otel-training-data">{data}</script>\n'
        f"<script>{_asset('uPlot.iife.min.js')}</script>\n<script>{_asset('report.js')}</script>\n</body></html>\n"
    )


def write_html(path: str, reports: Sequence[Report], comparison: Comparison | None = None) -> str:
    """Write the page (atomically); returns the path."""
    text = build_html(reports, comparison)
    from otel_training.report.sources import ReportError

    tmp = f"{path}.tmp{os.getpid()}"
    try:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise ReportError(f"cannot write {path!r}: {exc.strerror or exc}") from None
    return path
