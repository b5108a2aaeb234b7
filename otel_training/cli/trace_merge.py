"""``otel-training trace-merge -o OUT FILE...``: trace files on one clock, in one file.

Takes the per-rank files of ``OTEL_TRAINING_TRACE_FILE`` and, optionally,
torch.profiler (Kineto) Chrome traces of the same run. Both count ``ts`` in
microseconds from their own ``baseTimeNanoseconds`` (epoch ns); the merged file
counts from the smallest, every event shifted by the difference, so Perfetto UI
or chrome://tracing shows every rank's steps and phases next to the profiler's
operators. Where a profiler trace has events on the very thread our steps are on,
our events move to a track of their own in that process (``tid + 1000000000``,
named ``steps (...)``): slices on one track must nest, and ``ProfilerStep#N``
does not nest with our steps.
"""

from __future__ import annotations

import argparse
import json
import sys

_OWN_TRACK = 1_000_000_000


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path!r}: {exc}") from None
    if isinstance(doc, list):  # the JSON array form
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path!r} is not a Chrome trace-event file (no traceEvents)")
    return doc


def _ours(doc: dict) -> bool:
    return (doc.get("otherData") or {}).get("producer") == "otel-training"


def merge(docs: list[tuple[str, dict]]) -> dict:
    """One trace from several: ``ts`` rebased on the smallest ``baseTimeNanoseconds``."""
    bases = [int(doc.get("baseTimeNanoseconds") or 0) for _, doc in docs]
    base = min(bases)
    theirs = {(e.get("pid"), e.get("tid")) for _, d in docs if not _ours(d) for e in d["traceEvents"]}
    owner: dict = {}  # our pid -> the (host, rank) it belongs to, to keep ranks apart
    events: list = []
    for (path, doc), b in zip(docs, bases):
        shift = (b - base) / 1000
        ours = _ours(doc)
        who = ((doc.get("otherData") or {}).get("host"), (doc.get("otherData") or {}).get("rank"), path)
        pid_shift = 0
        if ours:
            pids = {e.get("pid") for e in doc["traceEvents"]}
            while any(owner.get(p + pid_shift, who)[:2] != who[:2] for p in pids):
                pid_shift += 10_000_000  # the same pid on two hosts: keep the ranks apart
            for p in pids:
                owner[p + pid_shift] = who
        for e in doc["traceEvents"]:
            e = dict(e)
            if "ts" in e:
                e["ts"] = float(e["ts"]) + shift
            if ours:
                e["pid"] = e.get("pid", 0) + pid_shift
                if (e.get("pid"), e.get("tid")) in theirs:
                    e["tid"] = e["tid"] + _OWN_TRACK
            events.append(e)
    return {
        "traceEvents": events,
        "baseTimeNanoseconds": base,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "otel-training trace-merge", "merged": [p for p, _ in docs]},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="otel-training trace-merge",
        description="Merge OTEL_TRAINING_TRACE_FILE rank files and torch.profiler traces on one clock.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="trace files (ours, one per rank; torch.profiler's)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="the merged trace file to write")
    args = p.parse_args(argv)
    try:
        merged = merge([(path, _load(path)) for path in args.files])
    except ValueError as exc:
        print(f"otel-training trace-merge: {exc}", file=sys.stderr)
        return 2
    try:
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(merged, fh, separators=(",", ":"))
    except OSError as exc:
        print(f"otel-training trace-merge: cannot write {args.output!r}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"otel-training trace-merge: {len(merged['traceEvents'])} events -> {args.output}", file=sys.stderr)
    return 0
