"""GPU timing modes side by side: ``off`` vs ``events`` vs ``sync`` (CUDA only).

Loops, each run in every mode, rounds interleaved in one process:

* ``gpu-bound``: a wide MLP, batches already pinned, ``loss.item()`` every step;
* ``data-bound``: a smaller MLP fed by a Dataset that sleeps (2 workers);
* ``gpt``: nanoGPT's model at GPT-2-small width (6 layers, T=256), bf16 autocast,
  fused AdamW, gradient clipping, pinned batches, ``loss.item()`` every step;
* ``gpt-compiled``: the same under ``torch.compile``.

Modes: ``plain`` (not instrumented), ``off``/``events``/``sync`` (the GPU timing
modes, hardware sampling off) and ``default`` (the shipped configuration: timing
``auto``, hardware sampling on). Reported: per-step wall time (median over rounds of
each run's median) and its ratio to ``off`` and to ``plain``; per-phase
GPU-synchronized durations of ``events`` against ``sync`` (relative difference, phases
>= 1 ms); GPU idle per step by phase. Targets: events <= 1.01 x off; default <= 1.01
x plain on the GPU-bound loops; events within 5% of sync for phases >= 1 ms.

    .venv/bin/python benchmarks/gpu_timing.py [--rounds 5] [--steps 40] [--loops gpu-bound,gpt]

``--via instrumentor`` (default) runs the real instrumentation (``TrainingInstrumentor``
with in-memory exporters) and reads the ``training.phase.duration`` and
``training.gpu.idle`` metrics; ``--via timers`` drives the device timers directly
(marks in the loop, a resolver thread standing in for the pipeline).
Without CUDA it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("off", "events", "sync", "default")
GPU_BOUND = ("gpu-bound", "gpt", "gpt-compiled")
TARGET_EVENTS_COST = 1.01
TARGET_DEFAULT_COST = 1.01  # the shipped configuration against an uninstrumented loop
TARGET_DURATION_DIFF = 0.05
MIN_PHASE_S = 1e-3
GPT_BATCH = 16  # --gpt-batch: sequences of 256 tokens per step


# -- workloads --------------------------------------------------------------------------------

def _make_loop(kind: str, device: str = "cuda"):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    torch.manual_seed(0)
    if kind.startswith("gpt"):
        return _make_gpt_loop(kind, device)
    if kind == "gpu-bound":
        width, depth, batch, sleep_s, workers = 4096, 8, 1024, 0.0, 0
    else:
        width, depth, batch, sleep_s, workers = 2048, 8, 1024, 0.016, 2
    if device == "cpu":  # --smoke: the harness itself, on a machine without CUDA
        width, batch, sleep_s = 64, 32, sleep_s / 8
    pin = device == "cuda"

    class Batches(Dataset):
        """Whole batches; ``sleep_s`` per batch stands for decoding/augmentation."""

        def __init__(self):
            self.x = torch.randn(batch, width)
            self.y = torch.randint(0, 10, (batch,))
            if pin and not workers:
                self.x, self.y = self.x.pin_memory(), self.y.pin_memory()

        def __len__(self):
            return 10**9

        def __getitem__(self, i):
            if sleep_s:
                time.sleep(sleep_s)
            return self.x, self.y

    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    loader = DataLoader(Batches(), batch_size=None, num_workers=workers, pin_memory=pin and bool(workers),
                        persistent_workers=bool(workers), prefetch_factor=2 if workers else None)

    def step_loss(x, y):
        return loss_fn(model(x), y)

    def update():
        opt.step()

    return model, opt, step_loss, update, loader, device


def _make_gpt_loop(kind: str, device: str):
    """nanoGPT's train.py step on its model (tests/gpt_model.py), bf16 autocast."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    from tests.gpt_model import GPT, GPTConfig

    if device == "cuda":
        cfg, batch = GPTConfig(block_size=256, vocab_size=50304, n_layer=6, n_head=12, n_embd=768), GPT_BATCH
    else:
        cfg, batch = GPTConfig(), 4
    pin = device == "cuda"

    class Tokens(Dataset):
        def __init__(self):
            x = torch.randint(cfg.vocab_size, (batch, cfg.block_size))
            y = torch.randint(cfg.vocab_size, (batch, cfg.block_size))
            self.x, self.y = (x.pin_memory(), y.pin_memory()) if pin else (x, y)

        def __len__(self):
            return 10**9

        def __getitem__(self, i):
            return self.x, self.y

    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device == "cuda")
    run = torch.compile(model) if kind == "gpt-compiled" else model
    dtype = torch.bfloat16

    def step_loss(x, y):
        with torch.autocast(device_type="cuda" if device == "cuda" else "cpu", dtype=dtype):
            _, loss = run(x, y)
        return loss

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    loader = DataLoader(Tokens(), batch_size=None, num_workers=0)
    return model, opt, step_loss, update, loader, device


def _train(loop, steps: int, warmup: int, phase=None, after_warmup=None) -> list:
    """Run ``warmup + steps`` steps; per-step wall times (s) of the last ``steps``.
    ``phase``: a context-manager factory marking phases (the direct-timer path);
    ``after_warmup``: called between the warm-up and the measured steps (untimed)."""
    model, opt, step_loss, update, loader, device = loop
    ph = phase or (lambda name: contextlib.nullcontext())
    walls = []
    it = iter(loader)
    last = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup and after_warmup is not None:
            after_warmup()
            last = time.perf_counter()
        with ph("dataloader_next"):
            x, y = next(it)
        with ph("to_device"):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with ph("forward"):
            loss = step_loss(x, y)
        with ph("backward"):
            opt.zero_grad(set_to_none=True)
            loss.backward()
        with ph("optimizer_step"):
            update()
        with ph("from_device"):
            loss.item()
        now = time.perf_counter()
        if i >= warmup:
            walls.append(now - last)
        last = now
    del it
    return walls


# -- path 1: the real instrumentation ------------------------------------------------------------

def _metric_sums(reader) -> dict:
    """{(metric, phase, parent): (sum, count)} from an InMemoryMetricReader (cumulative)."""
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name not in ("training.phase.duration", "training.gpu.idle", "training.step.duration"):
                    continue
                for p in m.data.data_points:
                    attrs = dict(p.attributes)
                    key = (m.name, attrs.get("training.phase"), attrs.get("training.phase.parent"))
                    total, count = out.get(key, (0.0, 0))
                    out[key] = (total + getattr(p, "sum", getattr(p, "value", 0.0)),
                                count + getattr(p, "count", 1))
    return out


def run_instrumented(loop, mode: str, steps: int, warmup: int) -> dict:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_training import runtime as rt
    from otel_training.config import load_config
    from otel_training.instrumentor import TrainingInstrumentor

    if mode == "plain":
        return {"walls": _train(loop, steps, warmup)}
    if mode == "default":  # as shipped, but no run-end table or file
        config = dataclasses.replace(load_config({}), summary=False, summary_file=None)
    else:
        config = dataclasses.replace(load_config({}), gpu_timing=mode, hardware=False, summary=False,
                                     summary_file=None, integrations=())
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    reader = InMemoryMetricReader()
    inst = TrainingInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=MeterProvider(metric_readers=[reader]), config=config)
    snapshot = {}

    def after_warmup():
        runtime.pipeline.flush(60)
        snapshot.update(_metric_sums(reader))

    try:
        runtime = rt.current()
        if runtime is None:  # the instrumentor refused (its log line says why, e.g. the torch floor)
            raise SystemExit("gpu_timing: otel-training did not instrument this process; nothing to measure")
        walls = _train(loop, steps, warmup, after_warmup=after_warmup)
        runtime.pipeline.flush(60)
        after = _metric_sums(reader)
        timing = runtime.timer.mode
    finally:
        inst.uninstrument()
    delta = {k: (total - snapshot.get(k, (0.0, 0))[0], count - snapshot.get(k, (0.0, 0))[1])
             for k, (total, count) in after.items()}
    n_steps = sum(c for (metric, _, _), (_, c) in delta.items() if metric == "training.step.duration")
    phases, idle = {}, {}
    for (metric, name, parent), (total, count) in delta.items():
        if metric == "training.phase.duration" and count > 0:
            phases[f"{parent}/{name}"] = total / count
        elif metric == "training.gpu.idle" and n_steps:
            idle[name] = idle.get(name, 0.0) + total / n_steps
    return {"walls": walls, "phases": phases, "idle": idle, "timing": timing}


# -- path 2: the device timers directly -------------------------------------------------------------

class DirectHarness:
    """Marks phases with a DeviceTimer and resolves finished steps on a thread, like
    the tracker and the pipeline do."""

    def __init__(self, timer):
        from otel_training.aggregate.idle import idle_between, synchronized_marks

        self.timer, self._sync, self._idle = timer, synchronized_marks, idle_between
        self.marks, self.tokens, self.phases = [], [], []
        self.queue: deque = deque()
        self.durations: dict = {}
        self.idle: dict = {}
        self.steps = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _mark(self) -> int:
        self.tokens.append(self.timer.mark())
        self.marks.append(time.perf_counter_ns())
        return len(self.marks) - 1

    @contextlib.contextmanager
    def phase(self, name: str):
        if name == "dataloader_next":  # a step starts where the previous one ends
            token, now = self.timer.mark(), time.perf_counter_ns()
            if self.marks:
                self.tokens.append(token)
                self.marks.append(now)
                self.queue.append((self.marks, self.tokens, self.phases))
            self.marks, self.tokens, self.phases = [now], [token], []
            start = 0
        else:
            start = self._mark()
        try:
            yield
        finally:
            self.phases.append((name, start, self._mark()))

    def _process(self, marks, tokens, phases) -> None:
        device = self.timer.resolve(marks, tokens) if self.timer.observes_device else None
        times = self._sync(marks, device)
        for name, s, e in phases:
            self.durations.setdefault(name, []).append((times[e] - times[s]) / 1e9)
            if device is not None:
                self.idle[name] = self.idle.get(name, 0.0) + self._idle(marks, device, s, e) / 1e9
        self.steps += 1

    def _run(self) -> None:
        while not self._stop or self.queue:
            if self.queue:
                self._process(*self.queue.popleft())
            else:
                time.sleep(0.005)

    def finish(self) -> None:
        self._stop = True
        self._thread.join(60)


def run_direct(loop, mode: str, steps: int, warmup: int) -> dict:
    from otel_training.timing import make_timer

    if mode == "plain":
        return {"walls": _train(loop, steps, warmup)}
    timer = make_timer("auto" if mode == "default" else mode)
    harness = DirectHarness(timer)

    def after_warmup():
        while harness.queue:
            time.sleep(0.005)
        time.sleep(0.05)  # the step being processed
        harness.durations.clear()
        harness.idle.clear()
        harness.steps = 0

    walls = _train(loop, steps, warmup, harness.phase, after_warmup)
    harness.finish()
    timing = timer.mode
    timer.close()
    phases = {f"step/{k}": statistics.mean(v) for k, v in harness.durations.items()}
    idle = {k: v / max(harness.steps, 1) for k, v in harness.idle.items()}
    return {"walls": walls, "phases": phases, "idle": idle, "timing": timing}


# -- report -------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    global GPT_BATCH
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--via", choices=("instrumentor", "timers"), default="instrumentor")
    parser.add_argument("--loops", default="gpu-bound,data-bound,gpt,gpt-compiled")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--gpt-batch", type=int, default=GPT_BATCH,
                        help="sequences per step of the gpt loops (64: GPU-bound on an H100)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny loops on the CPU: checks this harness only (timing falls back to off)")
    args = parser.parse_args(argv)
    GPT_BATCH = args.gpt_batch

    try:
        import torch
    except Exception as exc:  # pragma: no cover
        print(f"gpu_timing: torch is not importable ({exc}); nothing to measure.")
        return 0
    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_timing: no CUDA device here (torch.cuda.is_available() is False); nothing to measure.")
        return 0

    run = run_instrumented if args.via == "instrumentor" else run_direct
    modes = ("plain",) + MODES
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU smoke test"
    print(f"gpu_timing: {name}, torch {torch.__version__}, via {args.via}, "
          f"{args.rounds} rounds x {args.steps} steps")
    results = {}
    for kind in args.loops.split(","):
        loop = _make_loop(kind, device)
        runs = {m: [] for m in modes}
        for r in range(args.rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]  # rotate: no mode always first
            for mode in order:
                runs[mode].append(run(loop, mode, args.steps, args.warmup))
        results[kind] = runs
        if kind == "gpt-compiled":
            from torch._dynamo.utils import counters

            graphs = dict(counters["stats"])
            print(f"gpt-compiled: dynamo {graphs} (a recompile per instrument/uninstrument would show here)")
        del loop
        if device == "cuda":
            torch.cuda.empty_cache()

    misses = 0
    print(f"\n{'loop':<12} {'mode':<7} {'ms/step':>8} {'vs off':>7} {'vs plain':>8}")
    summary = {}
    for kind, runs in results.items():
        wall = {m: statistics.median(statistics.median(x["walls"]) for x in runs[m]) for m in modes}
        for m in modes:
            ratio, vs_plain = wall[m] / wall["off"], wall[m] / wall["plain"]
            note = ""
            if m == "events":
                ok = ratio <= TARGET_EVENTS_COST
                misses += not ok
                note = f"  target <= {TARGET_EVENTS_COST:.2f} x off: {'ok' if ok else 'MISS'}"
            elif m == "default" and kind in GPU_BOUND:
                ok = vs_plain <= TARGET_DEFAULT_COST
                misses += not ok
                note = f"  target <= {TARGET_DEFAULT_COST:.2f} x plain: {'ok' if ok else 'MISS'}"
            elif m == "sync":
                note = f"  sync costs {100 * (ratio - 1):+.1f}%"
            print(f"{kind:<12} {m:<7} {1e3 * wall[m]:8.2f} {ratio:7.3f} {vs_plain:8.3f}{note}")
        if kind in GPU_BOUND:  # where the shipped configuration's cost goes (events = default less sampling)
            print(f"{kind:<12} default's cost: {wall['default'] / wall['plain']:.3f} x plain = events "
                  f"{wall['events'] / wall['plain']:.3f} x plain (step timing) * default "
                  f"{wall['default'] / wall['events']:.3f} x events (hardware sampling)")
        summary[kind] = {"ms_per_step": {m: 1e3 * wall[m] for m in modes},
                         "quartiles_ms": {m: [1e3 * q for q in statistics.quantiles(
                             [w for x in runs[m] for w in x["walls"]], n=4)] for m in modes},
                         "timing": {m: runs[m][0].get("timing") for m in MODES}}

    print(f"\nphase durations, events vs sync (mean ms over rounds; phases >= {MIN_PHASE_S * 1e3:g} ms "
          f"must agree within {100 * TARGET_DURATION_DIFF:g}%)")
    print(f"{'loop':<12} {'phase':<30} {'events':>8} {'sync':>8} {'diff':>7}")
    for kind, runs in results.items():
        names = sorted(set().union(*(x["phases"] for x in runs["events"] + runs["sync"])))
        summary[kind]["phases"] = {}
        for name in names:
            ev = statistics.mean(x["phases"].get(name, 0.0) for x in runs["events"])
            sy = statistics.mean(x["phases"].get(name, 0.0) for x in runs["sync"])
            diff = (ev - sy) / sy if sy else float("nan")
            judged = sy >= MIN_PHASE_S
            ok = not judged or abs(diff) <= TARGET_DURATION_DIFF
            misses += not ok
            flag = ("ok" if ok else "MISS") if judged else "(< 1 ms)"
            print(f"{kind:<12} {name:<30} {1e3 * ev:8.3f} {1e3 * sy:8.3f} {100 * diff:+6.1f}%  {flag}")
            summary[kind]["phases"][name] = {"events_ms": 1e3 * ev, "sync_ms": 1e3 * sy, "diff": diff}

    print("\nGPU idle per step by phase (ms; events | sync)")
    for kind, runs in results.items():
        names = sorted(set().union(*(x["idle"] for x in runs["events"] + runs["sync"])))
        cells = []
        for name in names:
            ev = statistics.mean(x["idle"].get(name, 0.0) for x in runs["events"])
            sy = statistics.mean(x["idle"].get(name, 0.0) for x in runs["sync"])
            cells.append(f"{name} {1e3 * ev:.2f} | {1e3 * sy:.2f}")
            summary[kind].setdefault("idle_ms", {})[name] = {"events": 1e3 * ev, "sync": 1e3 * sy}
        print(f"{kind:<12} " + ("; ".join(cells) or "none"))

    if args.smoke:
        print("\nsmoke test on the CPU: timing fell back to off, the figures mean nothing")
    else:
        print(f"\n{'all targets met' if not misses else f'{misses} target(s) missed'}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
