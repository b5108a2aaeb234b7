"""``otel-training bench-data MODULE:FACTORY``: how fast can this input pipeline go?

``FACTORY()`` (imported from ``MODULE``, a module name or a ``.py`` path) returns one of:

- a ``Dataset`` (map-style; an iterable one gets the throughput sweep only);
- a dict of ``DataLoader`` keyword arguments with a ``"dataset"`` key (``batch_size``,
  ``collate_fn``, ``prefetch_factor`` ... are kept; ``num_workers``/``pin_memory`` are swept);
- a ``(dataset, transform)`` tuple: ``transform(dataset[i])`` is the sample.

The per-sample cost is split into *load* and *transform* when the dataset has
``load(i)`` and ``transform(raw)`` methods (``dataset[i] == transform(load(i))``) or a
transform is given (the tuple, or ``--transform MODULE:FN``). Then ``collate_fn`` is
timed and ``DataLoader`` throughput measured for each ``num_workers`` x ``pin_memory``
(``--seconds`` each, after the first batch). With ``--step-rate`` or ``--summary`` it
says whether the loader can feed the training step. Results are also exported as OTel
gauges when ``OTEL_METRICS_EXPORTER`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from otel_training.cli.bench_data.measure import (
    BenchError,
    _Transformed,
    advice,
    feed_check,
    knee,
    load_object,
    rate_from_summary,
    resolve,
    run_loader,
    time_collate,
    time_samples,
)

__all__ = ["main", "run", "BenchError"]


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _workers(text: str | None) -> list[int]:
    if text:
        try:
            out = sorted({int(x) for x in text.split(",") if x.strip()})
        except ValueError:
            out = []
        if not out or out[0] < 0:
            raise BenchError(f"--workers {text!r}: use a comma-separated list like 0,2,4")
        return out
    out, w, top = [0], 1, _cpus()
    while w <= top:
        out.append(w)
        w *= 2
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="otel-training bench-data", description="Benchmark a Dataset and the DataLoader settings that feed it."
    )
    p.add_argument("factory", metavar="MODULE:FACTORY", help="a callable returning the Dataset (see docs)")
    p.add_argument("--transform", metavar="MODULE:FN", help="per-sample transform applied to dataset[i]")
    p.add_argument("--batch-size", type=int, help="batch size (default: the factory's, the summary's, or 32)")
    p.add_argument("--workers", metavar="LIST", help="num_workers values to try (default 0,1,2,4,... up to CPUs)")
    p.add_argument(
        "--pin-memory",
        choices=("auto", "on", "off", "both"),
        default="auto",
        help="pin_memory values to try (auto: both when CUDA is available, else off)",
    )
    p.add_argument("--seconds", type=float, default=3.0, help="measuring time per configuration (default 3)")
    p.add_argument("--samples", type=int, default=64, help="samples timed one by one (default 64)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--step-rate", type=float, metavar="STEPS_PER_S", help="the training step rate to feed")
    rate.add_argument(
        "--summary", metavar="FILE", help="run-end summary: feed its train steps at their rate without data waits"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


class _Progress:
    """One status line on stderr, redrawn in place on a terminal."""

    def __init__(self, total: int, seconds: float, enabled: bool) -> None:
        self.total, self.seconds, self.enabled = total, seconds, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.index, self.label, self._last = 0, "", 0.0

    def begin(self, label: str) -> None:
        self.index += 1
        self.label = label
        self.update(0.0, 0.0, force=True)

    def update(self, elapsed: float, rate: float, force: bool = False) -> None:
        if not self.tty or (not force and time.monotonic() - self._last < 0.2):
            return
        self._last = time.monotonic()
        done = min(1.0, elapsed / self.seconds) if self.seconds else 1.0
        bar = "#" * int(20 * done) + "-" * (20 - int(20 * done))
        sys.stderr.write(f"\r[{self.index}/{self.total}] {self.label:<30} [{bar}] {rate:9.1f} samples/s")
        sys.stderr.flush()

    def end(self, rate: float) -> None:
        if not self.enabled:
            return
        line = f"[{self.index}/{self.total}] {self.label:<30} {rate:9.1f} samples/s"
        sys.stderr.write(("\r" + line + " " * 24 + "\n") if self.tty else line + "\n")
        sys.stderr.flush()


def run(args: argparse.Namespace) -> dict:
    """Measure everything; returns the result dict (``--json`` prints it)."""
    import torch
    from torch.utils.data import default_collate

    factory = load_object(args.factory, "FACTORY")
    transform = load_object(args.transform, "--transform") if args.transform else None
    try:
        made = factory()
    except Exception as exc:
        raise BenchError(f"FACTORY {args.factory!r} raised {type(exc).__name__}: {exc}") from None
    raw, transform, kwargs = resolve(made, transform)
    step_rate, source, summary_batch, measured = args.step_rate, "--step-rate", None, None
    if args.summary:
        step_rate, summary_batch, measured = rate_from_summary(args.summary)
        source = f"{args.summary} (train steps/s without data waits)"
    batch_size = args.batch_size or kwargs.get("batch_size") or summary_batch or 32
    if "batch_sampler" not in kwargs:
        kwargs["batch_size"] = batch_size
    if args.seconds <= 0 or batch_size <= 0:
        raise BenchError("--seconds and --batch-size must be > 0")
    dataset = _Transformed(raw, transform) if transform is not None else raw
    samples, loaded = time_samples(raw, transform, args.samples, budget=args.seconds)
    collate_ms = time_collate(loaded, kwargs.get("collate_fn") or default_collate, batch_size, budget=1.0)
    pins = {
        "on": [True],
        "off": [False],
        "both": [False, True],
        "auto": [False, True] if torch.cuda.is_available() else [False],
    }[args.pin_memory]
    configs = [(w, p) for p in pins for w in _workers(args.workers)]
    progress = _Progress(len(configs), args.seconds, not args.quiet)
    runs = []
    for w, p in configs:
        progress.begin(f"num_workers={w} pin_memory={p}")
        try:
            r = run_loader(dataset, kwargs, w, p, args.seconds, progress.update)
        except BenchError:
            raise
        except Exception as exc:
            raise BenchError(
                f"DataLoader(num_workers={w}, pin_memory={p}) failed: {type(exc).__name__}: {exc}"
            ) from None
        progress.end(r["samples_per_s"])
        runs.append(r)
    best = max(runs, key=lambda r: r["samples_per_s"])
    result = {
        "dataset": args.factory,
        "transform": args.transform,
        "batch_size": batch_size,
        "cpus": _cpus(),
        "samples": samples,
        "collate_ms": collate_ms,
        "runs": runs,
        "best": best,
        "knee": knee(runs),
        "feed": feed_check(runs, batch_size, step_rate, source, measured),
    }
    result["advice"] = advice(result)
    return result


def render(r: dict) -> str:
    s = r["samples"]
    lines = [f"bench-data {r['dataset']}: batch size {r['batch_size']}, {r['cpus']} CPUs"]
    if s.get("count"):
        parts = [f"{k[:-3]} {s[k]:.2f} ms" for k in ("load_ms", "transform_ms", "getitem_ms") if s.get(k)]
        lines.append(
            f"per sample ({s['count']} timed, one process): "
            + ", ".join(parts)
            + f" -> at most {1e3 / s['sample_ms']:.0f} samples/s per worker"
            if s["sample_ms"]
            else ""
        )
    if r["collate_ms"] is not None:
        per_sample = r["collate_ms"] / r["batch_size"]
        lines.append(f"collate: {r['collate_ms']:.2f} ms per batch ({per_sample:.3f} ms per sample)")
    lines += ["", f"  {'num_workers':>11}  {'pin_memory':>10}  {'samples/s':>10}  {'first batch s':>13}"]
    top = r["best"]["samples_per_s"] or 1.0
    for run_ in r["runs"]:
        bar = "#" * int(round(20 * run_["samples_per_s"] / top))
        lines.append(
            f"  {run_['num_workers']:>11}  {str(run_['pin_memory']):>10}  {run_['samples_per_s']:>10.1f}"
            f"  {run_['startup_s']:>13.2f}  {bar}"
        )
    b = r["best"]
    lines += [
        "",
        f"best: {b['samples_per_s']:.1f} samples/s with num_workers={b['num_workers']}, pin_memory={b['pin_memory']}",
    ]
    for pin, k in r["knee"].items():
        if k["still_scaling"]:
            lines.append(f"pin_memory={pin}: still scaling at the most workers tried")
        else:
            lines.append(
                f"pin_memory={pin}: adding workers stops helping at num_workers={k['workers']} "
                f"({k['samples_per_s']:.1f} samples/s, within 10% of the best)"
            )
    f = r.get("feed")
    if f:
        verdict = "CAN" if f["can_feed"] else "CANNOT"
        lines.append(
            f"feed: training needs {f['needed_samples_per_s']:.1f} samples/s ({f['step_rate']:.2f} steps/s "
            f"x {r['batch_size']}, from {f['rate_source']}); the loader {verdict} feed it "
            f"({f['headroom']:.2f}x)"
        )
        if f["fewest_workers"] is not None:
            lines.append(f"feed: num_workers={f['fewest_workers']} is the fewest that keeps up")
        lines += [f"feed: {note}" for note in f.get("notes") or ()]
    lines += [f"  - {a}" for a in r["advice"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = run(args)
    except BenchError as exc:
        print(f"otel-training bench-data: {exc}", file=sys.stderr)
        return 2
    from otel_training.cli.bench_data.export import export

    note = export(result)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print(render(result))
    if note:
        print(f"otel-training bench-data: {note}", file=sys.stderr)
    return 0
