"""GPU-synchronized phase durations against the kernel timeline (CUDA only).

``events`` and ``sync`` time different runs: ``sync`` drains the GPU at every phase
boundary, so the host's launch time of each phase's first kernels comes onto the GPU's
critical path, and a phase reads longer than it lasts in an undisturbed loop. The
reference for either is the GPU's own timeline of the same run. Here one loop runs
under ``torch.profiler`` (CUPTI: every kernel and copy with its GPU start and end, and
the host time of the call that launched it) while a device timer marks its phases. For
each phase, the instant the GPU reaches a boundary marked on the host at ``t`` is
``max(t, end of the last kernel launched before t)`` (one stream: work runs in launch
order), and the phase lasts from the GPU reaching its start to the GPU reaching its end.
That reconstruction is compared with what the timer measured, phase by phase.

    .venv/bin/python benchmarks/gpu_timing_profiler.py [--loops gpt,gpu-bound] [--modes events,sync] [--steps 20]

Target: each mode within 5 % of its own run's kernel timeline for phases >= 1 ms.
``--smoke`` runs the harness on the CPU (no kernels: the timeline is the host's).
Without CUDA (and without ``--smoke``) it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import DirectHarness, _make_loop, _train  # noqa: E402

TARGET = 0.05
MIN_PHASE_S = 1e-3
PREFIX = "otp::"
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def _timeline(trace: dict):
    """Sorted launch times (µs) with the running maximum of the GPU end of everything
    launched so far, and the phase annotations as (name, start µs, end µs)."""
    events = trace.get("traceEvents", [])
    launches = {}  # correlation id -> host launch time
    work = []  # (correlation, gpu end)
    phases = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, args = e.get("cat", ""), e.get("args") or {}
        if cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launches[args["correlation"]] = float(e["ts"])
        elif cat in GPU_WORK and "correlation" in args:
            work.append((args["correlation"], float(e["ts"]) + float(e.get("dur", 0.0))))
        elif cat == "user_annotation" and str(e.get("name", "")).startswith(PREFIX):
            phases.append((e["name"][len(PREFIX):], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    pairs = sorted((launches[c], end) for c, end in work if c in launches)
    times, reach = [], []
    best = float("-inf")
    for t, end in pairs:
        best = max(best, end)
        times.append(t)
        reach.append(best)
    return times, reach, phases, len(pairs)


def _gpu_reaches(times, reach, t: float) -> float:
    """When the GPU reaches a marker the host enqueued at ``t``."""
    i = bisect.bisect_left(times, t)
    return max(t, reach[i - 1]) if i else t


def run(kind: str, mode: str, steps: int, warmup: int, device: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from otel_training.timing import make_timer

    loop = _make_loop(kind, device)
    timer = make_timer(mode if device == "cuda" else "off")
    harness = DirectHarness(timer)

    @contextlib.contextmanager
    def phase(name):
        with record_function(PREFIX + name), harness.phase(name):
            yield

    _train(loop, 0, warmup, phase)  # warm-up: allocator, cuBLAS, autotuning
    while harness.queue:
        time.sleep(0.005)
    time.sleep(0.05)
    harness.durations.clear()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        _train(loop, 0, steps, phase)
        if device == "cuda":
            torch.cuda.synchronize()
    harness.finish()
    timing = timer.mode  # (a closed timer reads "off")
    timer.close()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    times, reach, annotations, n_work = _timeline(trace)
    kernel = {}
    for name, start, end in annotations:
        kernel.setdefault(name, []).append(
            (_gpu_reaches(times, reach, end) - _gpu_reaches(times, reach, start)) / 1e6)
    host = {}
    for name, start, end in annotations:
        host.setdefault(name, []).append((end - start) / 1e6)
    # The same steps on both sides: the harness hands a step on when the next one begins,
    # so its lists start with the last warm-up step and lack the last profiled one.
    measured = {k: statistics.mean(v[1:]) for k, v in harness.durations.items() if len(v) > 1}
    return {"measured": measured, "kernel": {k: statistics.mean(v[:-1]) for k, v in kernel.items() if len(v) > 1},
            "host": {k: statistics.mean(v[:-1]) for k, v in host.items() if len(v) > 1}, "gpu_work_items": n_work,
            "timing": timing}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", default="gpt,gpu-bound")
    parser.add_argument("--modes", default="events,sync")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--smoke", action="store_true", help="the harness on the CPU (timing off, no kernels)")
    args = parser.parse_args(argv)
    try:
        import torch
    except Exception as exc:  # pragma: no cover
        print(f"gpu_timing_profiler: torch is not importable ({exc}); nothing to measure.")
        return 0
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_timing_profiler: no CUDA device here; nothing to measure.")
        return 0
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU smoke test"
    print(f"gpu_timing_profiler: {name}, torch {torch.__version__}, {args.steps} profiled steps per run")
    print(f"{'loop':<10} {'mode':<7} {'phase':<16} {'measured':>9} {'kernels':>9} {'diff':>7} {'host':>9}")
    out, misses = {}, 0
    for kind in args.loops.split(","):
        for mode in args.modes.split(","):
            r = run(kind, mode, args.steps, args.warmup, device)
            out[f"{kind}/{mode}"] = r
            for ph in sorted(r["measured"]):
                m, k, h = r["measured"][ph], r["kernel"].get(ph, float("nan")), r["host"].get(ph, float("nan"))
                diff = (m - k) / k if k else float("nan")
                judged = k >= MIN_PHASE_S
                ok = not judged or abs(diff) <= TARGET
                misses += not ok
                flag = ("ok" if ok else "MISS") if judged else "(< 1 ms)"
                print(f"{kind:<10} {r['timing']:<7} {ph:<16} {1e3 * m:9.3f} {1e3 * k:9.3f} {100 * diff:+6.1f}% "
                      f"{1e3 * h:9.3f}  {flag}")
            if device == "cuda" and not r["gpu_work_items"]:
                print(f"{kind:<10} {mode:<7} no kernels in the trace: the reconstruction is the host's")
    print(f"\n{'all phases agree' if not misses else f'{misses} phase(s) off by more than 5%'} "
          f"(measured = the timer's GPU-synchronized mean; kernels = the same boundaries on the CUPTI timeline; "
          f"host = the annotation's own host duration)")
    if args.smoke:
        print("smoke test on the CPU: no kernels, the figures mean nothing")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
