"""Measurements for ``otel-training bench-data``: per-sample, collate, DataLoader sweep."""

from __future__ import annotations

import importlib
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

KNEE = 0.9  # "stops helping": within 10% of the best throughput


class BenchError(Exception):
    """A problem the user must fix; printed as one line, exit status 2."""


class _Transformed:
    """``dataset[i]`` passed through ``transform`` (picklable for worker processes)."""

    def __init__(self, dataset: Any, transform: Callable) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.transform(self.dataset[i])


def load_object(spec: str, what: str) -> Any:
    """``module:attr`` or ``path/file.py:attr`` -> the attribute."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise BenchError(f"{what} {spec!r} is not MODULE:NAME (e.g. mypkg.data:make_dataset)")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            if not os.path.exists(mod_name):
                raise BenchError(f"{what} {spec!r}: no file {mod_name!r}")
            # importable by its stem, so worker processes can unpickle what it defines
            sys.path.insert(0, os.path.dirname(os.path.abspath(mod_name)))
            stem = os.path.splitext(os.path.basename(mod_name))[0]
            spec_ = importlib.util.spec_from_file_location(stem, mod_name)
            if spec_ is None or spec_.loader is None:
                raise BenchError(f"{what} {spec!r}: cannot import {mod_name!r}")
            module = importlib.util.module_from_spec(spec_)
            sys.modules[stem] = module
            spec_.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except BenchError:
        raise
    except ImportError as exc:
        raise BenchError(f"{what} {spec!r}: cannot import {mod_name!r} ({exc})") from None
    except Exception as exc:
        raise BenchError(f"{what} {spec!r}: importing it raised {type(exc).__name__}: {exc}") from None
    obj = getattr(module, attr, None)
    if obj is None or not callable(obj):
        raise BenchError(f"{what} {spec!r}: {mod_name!r} has no callable {attr!r}")
    return obj


def resolve(obj: Any, transform: Callable | None) -> tuple:
    """FACTORY()'s result -> (raw dataset, transform or None, DataLoader kwargs)."""
    kwargs: dict = {}
    if isinstance(obj, dict):
        kwargs = dict(obj)
        if "dataset" not in kwargs:
            raise BenchError("FACTORY returned a dict without a 'dataset' key")
        obj = kwargs.pop("dataset")
    elif isinstance(obj, tuple) and len(obj) == 2 and callable(obj[1]):
        obj, transform = obj[0], transform or obj[1]
    for key in ("num_workers", "pin_memory", "persistent_workers"):
        kwargs.pop(key, None)  # swept / chosen here
    if not (hasattr(obj, "__getitem__") or hasattr(obj, "__iter__")):
        raise BenchError(
            f"FACTORY returned {type(obj).__name__}, not a Dataset, a dict of "
            "DataLoader arguments or a (dataset, transform) tuple"
        )
    return obj, transform, kwargs


# ----------------------------------------------------------------------- measurements
def _ms(values: list[float]) -> float | None:
    return 1e3 * statistics.fmean(values) if values else None


def time_samples(ds: Any, transform: Callable | None, count: int, budget: float) -> tuple:
    """Per-sample load/transform timing over up to ``count`` spread indices."""
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        return {"count": 0, "note": "iterable dataset: no per-sample timing"}, []
    n = len(ds)
    if n == 0:
        raise BenchError("the dataset is empty")
    split = transform is None and callable(getattr(ds, "load", None)) and callable(getattr(ds, "transform", None))
    idx = [int(i * n / min(n, count)) for i in range(min(n, count))]
    load, trans, samples = [], [], []
    deadline = time.perf_counter() + budget
    for i in idx:
        t0 = time.perf_counter()
        raw = ds.load(i) if split else ds[i]
        t1 = time.perf_counter()
        if split or transform is not None:
            apply: Any = ds.transform if split else transform
            sample = apply(raw)
            trans.append(time.perf_counter() - t1)
        else:
            sample = raw
        load.append(t1 - t0)
        samples.append(sample)
        if time.perf_counter() > deadline and len(samples) >= 2:
            break
    out: dict[str, Any] = {
        "count": len(samples),
        "split": "load/transform" if split else ("transform given" if transform is not None else "none"),
    }
    if trans:
        out.update(load_ms=_ms(load), transform_ms=_ms(trans), sample_ms=_ms([a + b for a, b in zip(load, trans)]))
    else:
        out.update(getitem_ms=_ms(load), sample_ms=_ms(load))
    return out, samples


def time_collate(samples: list[Any], collate: Callable, batch_size: int, budget: float) -> float | None:
    """Mean milliseconds of ``collate`` on one batch of already-loaded samples."""
    if not samples:
        return None
    batch = [samples[i % len(samples)] for i in range(batch_size)]
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < 50 and (len(times) < 3 or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        collate(batch)
        times.append(time.perf_counter() - t0)
    return _ms(times)


def run_loader(
    dataset: Any, kwargs: dict, workers: int, pin: bool, seconds: float, progress: Callable[[float, float], None]
) -> dict:
    """Samples/s of one DataLoader configuration (after its first batch)."""
    from torch.utils.data import DataLoader

    from otel_training.record.batches import infer_batch_size

    kw = dict(kwargs, num_workers=workers, pin_memory=pin)
    if workers:
        kw.update(persistent_workers=True)
        kw.setdefault("timeout", max(120.0, 10 * seconds))
    else:
        kw.pop("prefetch_factor", None)
    loader = DataLoader(dataset, **kw)
    fallback = kw.get("batch_size") or 1
    t0 = time.perf_counter()
    it = iter(loader)
    try:
        next(it)
    except StopIteration:
        raise BenchError("the DataLoader yields no batch") from None
    startup = time.perf_counter() - t0
    samples = batches = 0
    start = last = time.perf_counter()
    while last - start < seconds:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)  # next epoch (persistent workers are reused)
            continue
        samples += infer_batch_size(batch) or fallback
        batches += 1
        last = time.perf_counter()
        progress(last - start, samples / (last - start) if last > start else 0.0)
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    del it, loader
    elapsed = max(last - start, 1e-9)
    return {
        "num_workers": workers,
        "pin_memory": pin,
        "samples_per_s": samples / elapsed if batches else 0.0,
        "batches": batches,
        "startup_s": startup,
    }


# --------------------------------------------------------------------------- analysis
def knee(runs: list[dict]) -> dict:
    """Per pin_memory value: the fewest workers within 10% of that line's best."""
    out = {}
    for pin in sorted({r["pin_memory"] for r in runs}):
        line = sorted((r for r in runs if r["pin_memory"] == pin), key=lambda r: r["num_workers"])
        top = max(r["samples_per_s"] for r in line)
        k = next(r for r in line if r["samples_per_s"] >= KNEE * top)
        still = len(line) >= 2 and line[-1]["samples_per_s"] > 1.1 * line[-2]["samples_per_s"]
        out[str(pin).lower()] = {
            "workers": k["num_workers"],
            "samples_per_s": k["samples_per_s"],
            "still_scaling": still,
        }
    return out


WAITED = 0.05  # a run that waited this share of its train steps for data was not kept fed


def feed_check(
    runs: list[dict], batch_size: int, step_rate: float | None, source: str, measured: dict | None = None
) -> dict | None:
    """Can the loader deliver ``step_rate`` x ``batch_size`` samples/s *beside* the
    training, and which is the cheapest configuration that does?

    ``num_workers=0`` never keeps up: it loads each batch on the training thread, so
    every step waits for its batch however fast the loading is. ``measured`` (from
    ``--summary``): the run's own data wait and, when its summary has them, its loader
    settings; a configuration no larger than one the run waited with is not counted
    as keeping up (the sweep runs the loader alone, with the CPUs to itself)."""
    if not step_rate:
        return None
    need = step_rate * batch_size
    measured = measured or {}
    floor = 0  # configurations need more workers than this
    ran = measured.get("num_workers")
    waited = (measured.get("wait_share") or 0.0) >= WAITED
    if waited and ran is not None:
        floor = int(ran)
    parallel = [r for r in runs if r["num_workers"] > 0]
    enough = sorted(
        (r for r in parallel if r["samples_per_s"] >= need and r["num_workers"] > floor),
        key=lambda r: (r["num_workers"], r["pin_memory"]),
    )
    best = max(parallel or runs, key=lambda r: r["samples_per_s"])
    notes = []
    serial = [r for r in runs if r["num_workers"] == 0 and r["samples_per_s"] > 0]
    if serial:
        rate = max(r["samples_per_s"] for r in serial)
        wait_ms = 1e3 * batch_size / rate
        notes.append(
            f"num_workers=0 loads each batch on the training thread: every step would wait about "
            f"{wait_ms:.1f} ms for its batch ({100 * wait_ms / (wait_ms + 1e3 / step_rate):.0f}% of a step), "
            "as loading never overlaps compute"
        )
    if waited:
        with_ = f" with num_workers={ran}" if ran is not None else ""
        notes.append(
            f"the run waited {100 * measured['wait_share']:.1f}% of each train step "
            f"({measured['wait_ms']:.1f} ms) for data{with_}"
            + (f": configurations with num_workers <= {ran} are not counted as keeping up" if ran is not None else "")
        )
    return {
        "step_rate": step_rate,
        "rate_source": source,
        "needed_samples_per_s": need,
        "best_samples_per_s": best["samples_per_s"],
        "can_feed": bool(enough),
        "headroom": best["samples_per_s"] / need if need else None,
        "fewest_workers": enough[0]["num_workers"] if enough else None,
        "measured": measured or None,
        "notes": notes,
    }


def rate_from_summary(path: str) -> tuple:
    """(compute-only steps/s, batch size, what the run measured) of the train mode in a
    run-end summary; the last: its data wait (``wait_share``, ``wait_ms`` per step) and,
    from the summary's ``run`` section, the training loader's ``num_workers``."""
    from otel_training.report.sources import ReportError, read_summary

    try:
        s = read_summary(path)
    except ReportError as exc:
        raise BenchError(str(exc)) from None
    m = s.modes.get("train") or next(iter(s.modes.values()), None)
    if m is None or not m.steps:
        raise BenchError(f"summary file {path!r} holds no steps")
    wait = sum(p.total_s for p in m.phases if p.name == "dataloader_next" and p.parent == "step")
    busy = max(m.step_time_s - wait, 1e-9)
    batch = round(m.samples / m.steps) if m.samples else None
    measured: dict = {
        "wait_share": wait / m.step_time_s if m.step_time_s else 0.0,
        "wait_ms": 1e3 * wait / m.steps,
        "num_workers": None,
    }
    from otel_training.diagnosis.advice import train_loaders

    loaders = train_loaders(s.run) if s.run is not None else []
    if loaders:
        measured["num_workers"] = min(int(ld.num_workers or 0) for ld in loaders)
        batch = next((ld.batch_size for ld in loaders if ld.batch_size), batch)
    return m.steps / busy, batch, measured


def advice(report: dict) -> list[str]:
    out = []
    s = report["samples"]
    feed = report.get("feed")
    k = report["knee"].get("false") or next(iter(report["knee"].values()))
    most = max(r["num_workers"] for r in report["runs"])
    if k["still_scaling"]:
        out.append(
            f"throughput still grows at num_workers={most}, the most tried ({report['cpus']} CPUs): "
            f"try --workers {most},{2 * most},{4 * most} (waiting on I/O can use more workers than cores)"
        )
    elif k["workers"] == 0:
        out.append(
            "num_workers=0 gets within 10% of the best throughput, but it loads on the training "
            "thread, where loading never overlaps compute: use num_workers=1 or more"
        )
    else:
        out.append(f"num_workers={k['workers']} gets within 10% of the best; more workers add little")
    if s.get("transform_ms") and s.get("sample_ms") and s["transform_ms"] > 0.5 * s["sample_ms"]:
        out.append(
            f"the transform is {100 * s['transform_ms'] / s['sample_ms']:.0f}% of each sample: cache "
            "decoded/resized samples, use a faster decoder, or augment on the GPU"
        )
    elif s.get("load_ms") and s.get("sample_ms") and s["load_ms"] > 0.5 * s["sample_ms"]:
        out.append(
            f"loading is {100 * s['load_ms'] / s['sample_ms']:.0f}% of each sample: faster storage, "
            "larger sequential reads (shards), or an in-memory cache"
        )
    parallel = [r for r in report["runs"] if r["num_workers"] > 0]
    ran = ((feed or {}).get("measured") or {}).get("num_workers")
    if feed and not feed["can_feed"] and not parallel:
        out.append(
            "only num_workers=0 was tried, which loads on the training thread: every step waits for "
            "its batch; try --workers 0,1,2,4"
        )
    elif (
        feed and not feed["can_feed"] and ran is not None and feed["best_samples_per_s"] >= feed["needed_samples_per_s"]
    ):
        out.append(
            f"the run waited for data with num_workers={ran}, which the sweep alone would call enough "
            "(training competes with the workers for the CPUs): try more workers than "
            f"{ran} (--workers {ran},{2 * ran + 1},{4 * ran + 2})"
        )
    elif feed and not feed["can_feed"]:
        out.append(
            f"the loader cannot feed {feed['step_rate']:.1f} steps/s: training will wait on data "
            f"(best {feed['best_samples_per_s']:.0f} of {feed['needed_samples_per_s']:.0f} samples/s)"
        )
    return out
