"""A run's report, built once for every command that shows one (``report``,
``compare``, the HTML page, the demo): from summary files or Prometheus, with the
mode it is diagnosed for and its findings."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from otel_training.diagnosis.evidence import Evidence
from otel_training.diagnosis.verdict import diagnose, pick_mode
from otel_training.report.model import Report
from otel_training.report.prometheus import Prometheus, PrometheusReport
from otel_training.report.sources import ReportError, load_summaries, parse_duration, parse_time


def build_report(args: argparse.Namespace) -> Report:
    """The report, diagnosed (its ``mode`` and ``findings``)."""
    if args.summary:
        report = load_summaries(args.summary)
    else:
        end = parse_time(args.end) if args.end else time.time()
        start = parse_time(args.start) if args.start else end - parse_duration(args.since)
        prom = Prometheus(args.prometheus, args.timeout)
        report = PrometheusReport(prom, start, end).collect(args.run)
        if getattr(args, "series", False):  # the run over time, for charts
            from otel_training.report.series import PrometheusSeries

            hosts = sorted({r.host for rows in report.ranks.values() for r in rows if r.host})
            series, gpus = PrometheusSeries(prom, start, end).collect((report.selector or "{}")[1:-1], hosts)
            report = replace(report, timeseries=series, gpu_series=gpus)
    return diagnosed(report, args.mode)


def diagnosed(report: Report, wanted: str | None = None) -> Report:
    """``report`` with the ``mode`` it is diagnosed for and its ``findings``."""
    have = {name: m.as_mode() for name, m in report.modes.items()}
    mode = wanted or pick_mode(have)
    if wanted and not (mode in have and have[mode].steps):
        raise ReportError(f"no {mode} steps in this run (modes present: {', '.join(have) or 'none'})")
    return replace(report, mode=mode, findings=tuple(diagnose(evidence(report, mode))))


def evidence(report: Report, wanted: str | None) -> Evidence:
    """What the verdict reads of ``report``, for the ``wanted`` mode alone (none: no mode has steps)."""
    gpu = report.gpu_utilization
    return Evidence(
        modes={wanted: report.modes[wanted].as_mode()} if wanted else {},
        telemetry=report.telemetry,
        facts=report.run_facts,
        loaders=report.loaders or (),
        gpu_mean=gpu.mean if gpu is not None else None,
        ranks=tuple(r.times() for r in report.rank_rows(wanted)),
        memory=tuple(report.memories()),
        timeseries=report.timeseries or (),
    )


def report_json(report: Report) -> dict:
    """What ``otel-training report --json`` prints."""
    return report.to_dict()
