"""Device timers on CPU: the real CudaEventTimer and SyncTimer driven by a simulated
device (tests/fake_device.py), compared with the exact simulated completion times."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from otel_training.aggregate.idle import idle_between, synchronized_marks
from otel_training.timing import make_timer
from otel_training.timing.cuda_events import CudaEventTimer, OffsetEstimator
from otel_training.timing.device import DeviceTimer
from otel_training.timing.sync import SyncTimer
from tests.fake_device import MS, US, OracleTimer, SimBackend, SimDevice, SimLoop


class Both:
    """Marks with the real timer and the oracle at the same instants."""

    def __init__(self, timer, oracle):
        self.timer, self.oracle = timer, oracle
        self.observes_device = True

    def mark(self):
        token = self.timer.mark()
        return (token, self.oracle.mark())


def _events(dev, warm=True, **kw):
    kw.setdefault("capacity", 256)
    timer = CudaEventTimer(backend=SimBackend(dev), **kw)
    if warm:  # activation records the whole pool once: keep it out of the timed region
        assert timer.activate()
    return timer


def _pool(timer) -> int:
    """Events the timer can hand out now: marks until one gets no event, all given back."""
    taken = []
    while (token := timer.mark()) is not None:
        taken.append(token)
    timer.release([None, *taken, None])  # release() spares a step's first and last token
    return len(taken)


def _loop(dev, timer, steps, *, loader_ns=100 * US, fwd=(10, 1 * MS), item=True, pause_ns=0):
    loop = SimLoop(dev, Both(timer, OracleTimer(dev)))
    for _ in range(steps):
        loop.begin_step()
        with loop.phase("dataloader_next"):
            dev.clock.advance(loader_ns)
        with loop.phase("forward"):
            for _ in range(fwd[0]):
                dev.launch(fwd[1])
        if item:
            with loop.phase("from_device"):
                dev.item()
        dev.clock.advance(pause_ns)
    loop.end()
    return loop


def _resolve_all(timer, loop):
    """(events-mode device times, exact completion times) per step, resolved in order."""
    out = []
    for step in loop.steps:
        tokens = [t[0] for t in step.tokens]
        exact = [t[1] for t in step.tokens]
        out.append((step, timer.resolve(step.marks, tokens), exact))
    return out


# -- events mode -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(),
    dict(drift=10e-6),  # the device clock runs 10 ppm fast
    dict(clamp_negative=True),  # elapsed_time never negative
    dict(side_shares_queue=True),  # anchors queue behind user work (one hardware queue)
])
def test_events_match_exact_completion_times(kw):
    dev = SimDevice(**kw)
    timer = _events(dev, anchor_interval_s=0.05)
    loop = _loop(dev, timer, 30, loader_ns=3 * MS)
    for step, device, exact in _resolve_all(timer, loop):
        assert device is not None and None not in device
        for d, e in zip(device, exact):
            # Never later than the truth; earlier by at most the record call's own cost.
            assert e - 8 * US <= d <= e + 1 * US, (d - e)


def test_events_durations_are_device_intervals():
    dev = SimDevice()
    timer = _events(dev)
    loop = _loop(dev, timer, 5)
    for step, device, exact in _resolve_all(timer, loop):
        fwd = next(r for r in step.phases if r.name == "forward")
        dur = device[fwd.end] - device[fwd.start]
        host = step.marks[fwd.end] - step.marks[fwd.start]
        # Off by at most the event latency on an idle stream (2 us here).
        assert dur == pytest.approx(exact[fwd.end] - exact[fwd.start], abs=3 * US)
        assert dur >= 10 * MS > host  # the kernels run long after they were launched


def test_mark_never_waits_for_the_device():
    dev = SimDevice()
    timer = _events(dev)
    dev.launch(500 * MS)
    before = dev.clock.now
    tokens = [timer.mark() for _ in range(10)]
    assert dev.clock.now - before == 10 * dev.record_cost_ns
    assert all(t is not None for t in tokens)
    assert not dev.default.busy_until <= dev.clock.now  # the device is still busy


def test_resolve_waits_then_orders_monotonically():
    dev = SimDevice()
    timer = _events(dev)
    marks, tokens = [], []
    for ns in (5 * MS, 1 * MS, 20 * MS, 0, 3 * MS):
        dev.launch(ns)
        tokens.append(timer.mark())
        marks.append(dev.clock())
    assert dev.clock.now < dev.default.busy_until
    device = timer.resolve(marks, tokens)
    assert dev.clock.now >= dev.default.busy_until  # resolve waited (on the pipeline thread)
    assert device == sorted(device)
    assert device[-1] - device[0] == pytest.approx(24 * MS, abs=5 * US)
    assert synchronized_marks(marks, device) == sorted(synchronized_marks(marks, device))


def test_idle_attributed_with_real_event_timer_matches_ground_truth():
    dev = SimDevice(drift=5e-6)
    timer = _events(dev)
    loop = _loop(dev, timer, 8, loader_ns=25 * MS, item=False)
    for step, device, exact in _resolve_all(timer, loop)[1:]:
        rec = step.phases[0]
        assert rec.name == "dataloader_next"
        idle = idle_between(step.marks, device, rec.start, rec.end)
        truth = dev.idle_ns(step.marks[rec.start], step.marks[rec.end])
        assert truth > 10 * MS
        assert idle == pytest.approx(truth, abs=10 * US)


def test_pool_exhaustion_returns_none_without_blocking():
    dev = SimDevice()
    timer = _events(dev, capacity=4)
    dev.launch(100 * MS)
    marks, tokens = [], []
    for _ in range(6):
        tokens.append(timer.mark())
        marks.append(dev.clock())
    assert [t is None for t in tokens] == [False] * 4 + [True] * 2
    assert dev.clock.now < dev.default.busy_until  # nobody waited
    device = timer.resolve(marks, tokens)
    assert device[:4] == sorted(device[:4]) and device[4:] == [None, None]
    assert timer.mark() is not None  # resolved events went back to the pool


def test_release_returns_events_and_spares_shared_boundaries():
    dev = SimDevice()
    timer = _events(dev, capacity=8)
    loop = SimLoop(dev, timer)
    for _ in range(2):  # two steps of 4 marks; step 0's last token is step 1's first
        loop.begin_step()
        with loop.phase("forward"):
            dev.launch(1 * MS)
        dev.launch(1 * MS)
    first, second = loop.steps[0], loop.step
    assert second.tokens[0] is first.tokens[-1]
    assert _pool(timer) == 8 - 6
    timer.release(second.tokens)  # the second step is dropped
    assert _pool(timer) == 3  # its interior token now; the boundaries are shared
    device = timer.resolve(first.marks, first.tokens)  # the shared boundary still resolves
    assert None not in device
    assert _pool(timer) == 7
    timer.release(second.tokens)  # idempotent
    assert _pool(timer) == 7


def test_shared_boundary_resolves_once_for_both_steps():
    dev = SimDevice()
    timer = _events(dev)
    loop = _loop(dev, timer, 3, item=False)
    a, b = loop.steps[0], loop.steps[1]
    ta = [t[0] for t in a.tokens]
    tb = [t[0] for t in b.tokens]
    assert ta[-1] is tb[0]
    da = timer.resolve(a.marks, ta)
    # The event went back to the pool and may be recorded again meanwhile.
    for _ in range(5):
        timer.mark()
    db = timer.resolve(b.marks, tb)
    assert db[0] == da[-1]


def test_sweep_frees_tokens_of_steps_never_resolved():
    dev = SimDevice()
    timer = _events(dev, capacity=16)
    loop = SimLoop(dev, timer)
    for _ in range(3):
        loop.begin_step()
        with loop.phase("forward"):
            dev.launch(1 * MS)
    loop.end()
    skipped, _, last = loop.steps
    # The pipeline never resolves nor releases the first step (e.g. it had one mark).
    timer.resolve(last.marks, last.tokens)
    assert _pool(timer) == 16  # all back: the skipped steps' by the sweep
    assert all(t.event is None for t in skipped.tokens)


def test_cuda_graph_capture_and_uninitialized_cuda_give_no_token():
    dev = SimDevice()
    dev.initialized = False
    timer = _events(dev, warm=False, capacity=4)
    assert timer.mark() is None and timer.mode == "off" and not timer.observes_device
    dev.initialized = True
    assert timer.mark() is not None and timer.mode == "events" and timer.observes_device
    dev.capturing = True
    assert timer.mark() is None
    dev.capturing = False
    assert _pool(timer) == 3  # the capture did not consume an event


def test_timing_follows_the_current_stream():
    dev = SimDevice()
    timer = _events(dev)
    user = dev.new_stream("user")
    marks, tokens = [], []

    def mark():
        tokens.append(timer.mark())
        marks.append(dev.clock())

    mark()
    dev.launch(30 * MS)  # default stream
    with dev.stream(user):
        mark()
        dev.launch(5 * MS)
        mark()
    device = timer.resolve(marks, tokens)
    # Marks on the user stream do not wait for the default stream's 30 ms.
    assert device[2] - device[1] == pytest.approx(5 * MS, abs=5 * US)
    assert device[1] < dev.default.busy_until - 20 * MS


def test_side_stream_prefetch_is_seen_after_wait_stream():
    dev = SimDevice()
    timer = _events(dev)
    copy = dev.new_stream("prefetch")
    marks, tokens = [], []
    with dev.stream(copy):
        dev.launch(8 * MS)  # the next batch's copy
    tokens.append(timer.mark()); marks.append(dev.clock())
    dev.wait_stream(dev.default, copy)
    dev.launch(1 * MS)
    tokens.append(timer.mark()); marks.append(dev.clock())
    device = timer.resolve(marks, tokens)
    assert device[1] - marks[0] == pytest.approx(9 * MS, abs=10 * US)


def test_close_stops_resolving():
    dev = SimDevice()
    timer = _events(dev)
    tokens = [timer.mark(), timer.mark()]
    timer.close()
    assert timer.resolve([0, 1], tokens) is None
    assert timer.mark() is None


def test_resolve_failure_falls_back_without_raising(caplog):
    dev = SimDevice()
    timer = _events(dev)
    tokens = [timer.mark(), timer.mark()]

    def boom(*a):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    tokens[0].event.elapsed_time = boom
    tokens[1].event.elapsed_time = boom
    with caplog.at_level(logging.WARNING, logger="otel_training"):
        assert timer.resolve([0, 1], tokens) is None
    assert caplog.text.count("CUDA event timing failed") == 1


def test_offset_estimator_keeps_the_tightest_bound_with_drift():
    est = OffsetEstimator(drift=10e-6)
    assert est.offset(0) is None
    est.add(0, 1_000)
    est.add(1_000_000_000, 900)  # 1 s later
    assert est.offset(0) == 1_000
    assert est.offset(1_000_000_000) == 900  # 10 ppm of 1 s widens the old one to -9000
    assert est.offset(500_000_000) == 1_000 - 5_000
    est.add(1_000_000_000, 5_000)
    assert est.offset(1_000_000_000) == 5_000
    est.rebase(250)
    assert est.offset(1_000_000_000) == 5_250


# -- sync mode ---------------------------------------------------------------------------------

def test_sync_timer_blocks_at_marks_and_device_equals_host():
    dev = SimDevice()
    timer = SyncTimer(backend=SimBackend(dev), clock=dev.clock)
    dev.launch(7 * MS)
    t0 = dev.clock.now
    token = timer.mark()
    m0 = dev.clock()
    assert token == t0 and m0 >= dev.default.busy_until  # waited for the device
    dev.launch(2 * MS)
    token1 = timer.mark()
    m1 = dev.clock()
    device = timer.resolve([m0, m1], [token, token1])
    assert list(device) == [m0, m1]
    assert device.arrivals == [t0, token1]
    assert m1 - m0 == pytest.approx(2 * MS + dev.launch_cost_ns, abs=1 * US)


def test_sync_timer_inactive_until_cuda_initialized():
    dev = SimDevice()
    dev.initialized = False
    timer = SyncTimer(backend=SimBackend(dev), clock=dev.clock)
    assert timer.mark() is None and dev.syncs == 0
    assert timer.resolve([0, 1], [None, None]) is None
    dev.initialized = True
    assert timer.mark() is not None and dev.syncs == 1


# -- make_timer ------------------------------------------------------------------------------

def test_make_timer_modes_on_a_machine_without_cuda(caplog):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with caplog.at_level(logging.WARNING, logger="otel_training"):
        assert type(make_timer("off")) is DeviceTimer
        assert type(make_timer("auto")) is DeviceTimer
        assert caplog.text == ""  # auto without CUDA is silent
        assert type(make_timer("events")) is DeviceTimer
        assert type(make_timer("sync")) is DeviceTimer
        assert type(make_timer("bogus")) is DeviceTimer
    lines = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 3 and "CUDA is not available" in lines[0].getMessage()


def test_make_timer_with_a_backend_and_bad_options():
    dev = SimDevice()
    assert isinstance(make_timer("events", backend=SimBackend(dev)), CudaEventTimer)
    assert isinstance(make_timer("auto", backend=SimBackend(dev)), CudaEventTimer)
    assert isinstance(make_timer("sync", backend=SimBackend(dev)), SyncTimer)
    assert type(make_timer("events", capacity="many", backend=SimBackend(dev))) is DeviceTimer


def test_package_imports_and_falls_back_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from otel_training.timing import make_timer\n"
        "import otel_training.timing.cuda_events, otel_training.aggregate.idle\n"
        "t = make_timer('auto'); assert t.mark() is None and t.mode == 'off', t\n"
        "assert make_timer('events').mode == 'off'\n"
        "assert make_timer('sync').mode == 'off'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert "torch is unusable" in out.stderr


# -- the benchmark ---------------------------------------------------------------------------

def _bench(*args, script="gpu_timing.py"):
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, str(root / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})


def test_benchmark_without_cuda_prints_one_line_and_exits_0():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = _bench()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().count("\n") == 0 and "no CUDA device" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("via", ["instrumentor", "timers"])
def test_benchmark_harness_smoke_on_cpu(via):
    import re

    out = _bench("--smoke", "--via", via, "--rounds", "1", "--steps", "3", "--warmup", "2",
                 "--loops", "gpu-bound,gpt")
    assert out.returncode == 0, out.stderr
    for loop in ("gpu-bound", "gpt"):
        for mode in ("plain", "off", "events", "sync", "default"):
            assert re.search(rf"^{loop}\s+{mode}\s+\d", out.stdout, re.M), (loop, mode, out.stdout)
        assert re.search(rf"^{loop}\s+(train_batch|step)/forward\s", out.stdout, re.M), out.stdout
        split = re.search(rf"^{loop}\s+default's cost: ([\d.]+) x plain = events ([\d.]+) x plain .* \* default "
                          r"([\d.]+) x events \(hardware sampling\)", out.stdout, re.M)
        assert split, out.stdout
        total, timing, sampling = map(float, split.groups())
        # each figure printed to 3 decimals: the product of two rounded factors is off by up
        # to half a unit of the last place times their sum, and the total by half a unit more
        assert total == pytest.approx(timing * sampling, abs=0.0005 * (timing + sampling + 1) + 1e-9), split.group(0)


@pytest.mark.slow
def test_profiler_benchmark_smoke_on_cpu():
    """The kernel-timeline harness parses a real torch.profiler trace: on the CPU (no
    kernels) the timeline is the host's, so every phase agrees with its annotation."""
    import re

    out = _bench("--smoke", "--steps", "4", "--warmup", "1", "--loops", "gpt", "--modes", "events",
                 script="gpu_timing_profiler.py")
    assert out.returncode == 0, out.stderr
    for phase in ("forward", "backward", "optimizer_step"):
        row = re.search(rf"^gpt\s+off\s+{phase}\s+([\d.]+)\s+([\d.]+)\s", out.stdout, re.M)
        assert row, out.stdout
        measured, timeline = map(float, row.groups())
        assert measured > 0 and timeline == pytest.approx(measured, rel=0.5), row.group(0)


def test_a_timer_waiting_for_cuda_is_asked_once_a_step_not_at_every_boundary():
    """A CPU loop on a GPU machine (``auto``, CUDA never initialized): host marks alone,
    one readiness check a step. Once the program initializes CUDA (here mid-step), the
    steps from the next one on carry device tokens aligned with their marks, and
    resolve to device times."""
    from otel_training.record.step_assembly import StepAssembler
    from otel_training.record.tracker import Tracker

    dev = SimDevice()
    dev.initialized = False
    backend = SimBackend(dev)
    asked = []
    ready = backend.ready
    backend.ready = lambda: asked.append(1) or ready()
    timer = CudaEventTimer(capacity=64, backend=backend)
    steps: list = []
    tracker = Tracker(StepAssembler(steps.append, release=timer.release), timer, clock=dev.clock)

    def step(init_after: str = "") -> None:
        tracker.start_step()
        for name in ("load", "compute", "log"):
            dev.clock.advance(100 * US)
            tracker.begin_phase(name)
            dev.launch(50 * US)
            tracker.end_phase(name)
            if name == init_after:
                dev.initialized = True  # the program's first CUDA call
        tracker.finish_step()

    for _ in range(4):
        step()
    assert len(steps) == 4 and len(asked) == 4  # one check a step, 8 boundaries each
    assert all(not s.tokens for s in steps) and not timer.observes_device
    step(init_after="load")
    assert not steps[4].tokens  # the step CUDA started in stays on host marks
    for _ in range(3):
        step()
    assert timer.observes_device and len(asked) == 6  # no more checks once started
    for s in steps[5:]:
        assert len(s.tokens) == len(s.marks) and sum(t is not None for t in s.tokens) >= len(s.marks) - 1
        device = timer.resolve(s.marks, s.tokens)
        assert device is not None and sum(d is not None for d in device) >= len(s.marks) - 1


def test_device_timing_that_starts_between_a_steps_pieces_keeps_the_step_whole(instrumented, monkeypatch):
    """Gradient accumulation (two micro-batches a step, a DataLoader) where the program
    initializes CUDA after the first micro-batch of the third step: that step merges a
    piece recorded on host clocks alone with one carrying device tokens, and still
    resolves -- every step counted, no internal error, no step without its phases."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    import otel_training.timing as timing

    dev = SimDevice()
    dev.initialized = False
    monkeypatch.setattr(timing, "make_timer", lambda mode, **o: CudaEventTimer(capacity=256, backend=SimBackend(dev)))
    tel = instrumented(trace_every_n=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    for i, (x, y) in enumerate(DataLoader(data, batch_size=4)):
        loss = torch.nn.functional.cross_entropy(model(x), y) / 2
        loss.backward()
        if i == 4:
            dev.initialized = True  # the program's first CUDA call, mid-step
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    tel.uninstrument()
    summary = tel.runtime.summary_dict()
    assert summary["telemetry"]["errors"] == 0
    assert summary["modes"]["train"]["steps"] == 8
    steps = [s for s in tel.steps() if s.mode == "train"]
    assert len(steps) == 8
    for s in steps:
        names = sorted(c.name for c in s.children())
        assert "dataloader_next" in names and "train_batch" in names, names
