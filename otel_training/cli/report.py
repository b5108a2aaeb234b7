"""``otel-training report``: where does the step go, and what to do about it.

Reads run-end summary files (``--summary FILE ...``, one per rank) or a Prometheus
(``--prometheus URL --run RUN --since 1h``), prints per-phase shares of step time,
GPU utilization, the spread across ranks and throughput, then ranked advice from
:mod:`otel_training.diagnosis.verdict`. ``--html FILE`` also writes it as one offline
HTML page with charts (``--compare B``: run B beside it, as ``compare`` does).
Exit status: 0, or 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from otel_training.report.build import build_report, report_json
from otel_training.report.model import Report
from otel_training.report.sources import ReportError

__all__ = ["main", "build_report", "ReportError"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="otel-training report",
        description="Break a training run's step time into phases, show GPU utilization and "
        "rank spread, and say what holds the step.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--summary",
        nargs="+",
        metavar="FILE",
        help="run-end summary JSON file(s) (OTEL_TRAINING_SUMMARY_FILE), one per rank of one run: "
        "names, comma-separated or a quoted glob",
    )
    src.add_argument("--prometheus", metavar="URL", help="Prometheus base URL, e.g. http://localhost:9090")
    p.add_argument(
        "--run",
        metavar="RUN",
        help="with --prometheus: a training_run_id or job (service name), or label "
        "matchers like 'job=train,training_run_id=abc'; default: the only run in range",
    )
    p.add_argument(
        "--since", default="1h", metavar="DURATION", help="with --prometheus: how far back from --end (default 1h)"
    )
    p.add_argument("--start", metavar="TIME", help="range start (unix seconds or ISO 8601); overrides --since")
    p.add_argument("--end", metavar="TIME", help="range end (default: now)")
    p.add_argument("--mode", choices=("train", "eval"), help="mode to diagnose (default: train when present)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per Prometheus query")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--html", metavar="FILE", help="also write an offline HTML report with charts to FILE")
    p.add_argument(
        "--compare",
        nargs="+",
        metavar="B",
        help="with --html: a second run shown side by side (summary file(s), or with --prometheus a run)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.series = bool(args.html)
    try:
        if args.compare and not args.html:
            raise ReportError("--compare needs --html (or use otel-training compare A B)")
        report = build_report(args)
        if args.html:
            _write_html(args, report)
    except ReportError as exc:
        print(f"otel-training report: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report_json(report), sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        from otel_training.report.text import render

        print(render(report))
    return 0


def _write_html(args: argparse.Namespace, report: Report) -> None:
    from otel_training.report.page import write_html

    if not args.compare:
        write_html(args.html, [report], None)
    else:
        from otel_training.report.compare import compare

        other = argparse.Namespace(**vars(args))
        if args.prometheus:
            if len(args.compare) != 1:
                raise ReportError("--compare with --prometheus takes one run")
            other.run = args.compare[0]
        else:
            other.summary = args.compare  # names, comma lists or quoted globs
        second = build_report(other)
        write_html(args.html, [report, second], compare(report, second, report.mode))
    print(f"otel-training report: wrote {args.html}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
