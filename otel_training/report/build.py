"""A run's report, built once for every command that shows one (``report``,
``compare``, the HTML page, the demo): from summary files or Prometheus, with the
mode it is diagnosed for and its findings."""

from __future__ import annotations

import argparse
import time

from otel_training.diagnosis.verdict import diagnose, pick_mode
from otel_training.report.prometheus import Prometheus, PrometheusReport
from otel_training.report.sources import ReportError, load_summaries, parse_duration, parse_time
from otel_training.report.views import evidence, modes


def build_report(args: argparse.Namespace) -> dict:
    """The report dict with ``mode`` and ``findings`` (Finding objects) added."""
    if args.summary:
        report = load_summaries(args.summary)
    else:
        end = parse_time(args.end) if args.end else time.time()
        start = parse_time(args.start) if args.start else end - parse_duration(args.since)
        prom = Prometheus(args.prometheus, args.timeout)
        report = PrometheusReport(prom, start, end).collect(args.run)
        if getattr(args, "series", False):  # the run over time, for charts
            from otel_training.report.series import PrometheusSeries

            hosts = sorted({r["host"] for rows in report["ranks"].values() for r in rows if r.get("host")})
            series = PrometheusSeries(prom, start, end).collect(report["selector"][1:-1], hosts)
            report.update(timeseries=series["ranks"], gpu_series=series["gpus"])
    return diagnosed(report, args.mode)


def diagnosed(report: dict, wanted: str | None = None) -> dict:
    """``report`` with the ``mode`` it is diagnosed for and its ``findings``."""
    have = modes(report)
    mode = wanted or pick_mode(have)
    if wanted and not (mode in have and have[mode].steps):
        raise ReportError(f"no {mode} steps in this run (modes present: {', '.join(have) or 'none'})")
    report["mode"] = mode
    report["findings"] = diagnose(evidence(report, mode))
    return report


def report_json(report: dict) -> dict:
    """What ``otel-training report --json`` prints: the report, its findings as dicts."""
    return dict(report, findings=[f.to_dict() for f in report["findings"]])
