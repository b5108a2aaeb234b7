"""``otel-training compare A B``: did run B get faster than run A, and where?

A and B are summary files (several ranks: comma-separated, or a quoted glob) or,
with ``--prometheus URL``, two runs (``training_run_id``, job or label matchers).
Per phase, step time, throughput and verdict, A vs B with deltas; overall
``improvement``, ``regression`` or ``inconclusive``, judged against each run's own
noise (``--threshold``: the floor; the model: :mod:`otel_training.report.compare`).

``--fail-on-regression PCT`` makes it a CI gate: exit status 1 when B's step time is
worse than A's by more than PCT percent and by more than ``Z`` times the combined
standard error (with the noise unknown, PCT alone decides), else 0. Exit status 2 with
one line when the runs cannot be read or compared.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from otel_training.report.compare import FLOOR, Z, compare, gate, render
from otel_training.report.model import Report
from otel_training.report.sources import ReportError, summary_paths


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="otel-training compare",
        description="Compare two runs: per phase, step time, throughput and verdict, with an "
        "improvement / regression / inconclusive judged against run-to-run noise. With "
        "--fail-on-regression PCT it is a CI gate: exit status 1 when B's step time is "
        "significantly worse than A's by more than PCT percent, else 0.",
    )
    p.add_argument(
        "a",
        metavar="A",
        help="run A: summary file(s), comma-separated or a quoted glob; "
        "with --prometheus a training_run_id, job or label matchers",
    )
    p.add_argument("b", metavar="B", help="run B, the same way")
    p.add_argument("--prometheus", metavar="URL", help="read both runs from this Prometheus")
    p.add_argument("--since", default="1h", metavar="DURATION", help="with --prometheus: how far back (default 1h)")
    p.add_argument("--start", metavar="TIME", help="range start (unix seconds or ISO 8601)")
    p.add_argument("--end", metavar="TIME", help="range end (default: now)")
    p.add_argument("--mode", choices=("train", "eval"), help="mode to compare (default: train when present)")
    p.add_argument(
        "--threshold",
        type=float,
        default=FLOOR,
        metavar="SHARE",
        help=f"smallest relative change that counts, whatever the noise (default {FLOOR})",
    )
    p.add_argument(
        "--fail-on-regression",
        type=float,
        metavar="PCT",
        help="CI gate: exit 1 when B's step time is worse than A's by more than PCT percent "
        f"and beyond {Z:g} x the runs' noise, else 0",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per Prometheus query")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--html", metavar="FILE", help="also write both runs side by side as an HTML report")
    return p


def load_run(arg: str, args: argparse.Namespace) -> Report:
    """One run as a report with its time series and findings."""
    from otel_training.report.build import build_report

    ns = argparse.Namespace(**vars(args))
    if args.prometheus:
        ns.summary, ns.run = None, arg
    else:
        ns.summary, ns.run = summary_paths(arg), None
    ns.series = True
    return build_report(ns)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if not 0 <= args.threshold < 1:
            raise ReportError(f"--threshold {args.threshold} is not a share between 0 and 1")
        pct = args.fail_on_regression
        if pct is not None and not (pct >= 0 and math.isfinite(pct)):
            raise ReportError(f"--fail-on-regression {pct:g} is not valid: use a percentage >= 0, e.g. 10")
        a, b = load_run(args.a, args), load_run(args.b, args)
        result = compare(a, b, args.mode, args.threshold)
        if pct is not None:
            result = replace(result, gate=gate(result, pct))
        if args.html:
            from otel_training.report.page import write_html

            write_html(args.html, [a, b], result)
    except ReportError as exc:
        print(f"otel-training compare: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print(render(result))
    if args.html:
        print(f"otel-training compare: wrote {args.html}", file=sys.stderr)
    return 1 if result.gate is not None and result.gate.failed else 0
