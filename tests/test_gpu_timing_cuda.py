"""The real CudaEventTimer and SyncTimer on a CUDA device (skipped elsewhere).

    .venv/bin/python -m pytest -m gpu tests/test_gpu_timing_cuda.py
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from otel_training.aggregate.idle import idle_between  # noqa: E402
from otel_training.timing.cuda_events import CudaEventTimer  # noqa: E402
from otel_training.timing import make_timer  # noqa: E402
from otel_training.timing.sync import SyncTimer  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MS = 1_000_000
US = 1_000


@pytest.fixture(scope="module")
def mats():
    torch.cuda.init()
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    return a, b


def _matmul_ms(a, b, n):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        a @ b
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


class Recorder:
    def __init__(self, timer):
        self.timer, self.marks, self.tokens = timer, [], []

    def __call__(self):
        self.tokens.append(self.timer.mark())  # the tracker's order: token, then host time
        self.marks.append(time.perf_counter_ns())

    def resolve(self):
        return self.timer.resolve(self.marks, self.tokens)


def _warm(timer):
    rec = Recorder(timer)
    rec()
    rec()
    rec.resolve()


def _phase(timer, a, b, n):
    """(host ns, device ns) of one phase of ``n`` matmuls starting on an idle device."""
    torch.cuda.synchronize()
    rec = Recorder(timer)
    rec()
    for _ in range(n):
        a @ b
    rec()
    device = rec.resolve()
    return rec.marks[1] - rec.marks[0], device[1] - device[0]


def test_events_duration_covers_the_kernels_and_matches_sync(mats):
    a, b = mats
    n = max(2, int(20 / max(_matmul_ms(a, b, 1), 0.05)))  # a phase of ~20 ms of kernels
    events, sync = CudaEventTimer(capacity=64), SyncTimer()
    _warm(events)
    _warm(sync)
    ev_dev, ev_host, sync_dur = [], [], []
    for _ in range(7):  # interleaved: clocks and boost states drift over time
        host, dev = _phase(events, a, b, n)
        ev_host.append(host)
        ev_dev.append(dev)
        sync_dur.append(_phase(sync, a, b, n)[0])
    for host, dev in zip(ev_host, ev_dev):
        assert dev >= host  # launching ended long before the kernels did
    ev, sy = statistics.median(ev_dev), statistics.median(sync_dur)
    assert abs(ev - sy) / sy <= 0.05, (ev / 1e6, sy / 1e6)
    assert ev > 5 * statistics.median(ev_host)  # and host timing would have been far off


def test_events_mark_never_waits_and_resolve_releases_the_gil(mats):
    a, b = mats
    timer = CudaEventTimer(capacity=64)
    _warm(timer)
    n = max(2, int(300 / max(_matmul_ms(a, b, 1), 0.05)))
    torch.cuda.synchronize()
    rec = Recorder(timer)
    rec()
    for _ in range(n):
        a @ b
    t = time.perf_counter()
    for _ in range(20):
        rec()
    mark_s = time.perf_counter() - t
    assert mark_s < 0.005  # 20 marks while ~300 ms of work is queued
    assert not torch.cuda.current_stream().query()

    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("device", rec.resolve()))
    thread.start()
    spins, t = 0, time.perf_counter()
    while time.perf_counter() - t < 0.1:  # the training thread keeps running meanwhile
        spins += 1
    waiting = thread.is_alive()
    thread.join(30)
    assert waiting and "device" in result
    baseline, t = 0, time.perf_counter()
    while time.perf_counter() - t < 0.1:
        baseline += 1
    assert spins > 0.5 * baseline
    device = result["device"]
    assert device == sorted(device) and device[-1] - device[0] > 100 * MS


def test_events_map_to_the_host_clock_on_an_idle_device(mats):
    timer = CudaEventTimer(capacity=64, anchor_interval_s=0.05)
    _warm(timer)
    torch.cuda.synchronize()
    rec = Recorder(timer)
    for _ in range(40):
        time.sleep(0.003)
        rec()
    device = rec.resolve()
    errors = [d - h for d, h in zip(device, rec.marks)]
    # An event on an idle stream completes right when it is recorded.
    assert -50 * US < min(errors) and max(errors) < 100 * US, (min(errors), max(errors))


def test_events_idle_in_a_data_bound_loop(mats):
    a, b = mats
    n = max(2, int(5 / max(_matmul_ms(a, b, 1), 0.05)))  # ~5 ms of kernels a step
    gpu_ms = _matmul_ms(a, b, n)
    timer = CudaEventTimer(capacity=256)
    _warm(timer)
    torch.cuda.synchronize()
    rec = Recorder(timer)
    starts = []
    for _ in range(6):
        starts.append(len(rec.marks))
        rec()  # dataloader_next begins (the previous step's work may still run)
        time.sleep(0.02)  # a slow loader
        rec()  # forward begins
        for _ in range(n):
            a @ b
    rec()
    device = rec.resolve()
    for s in starts[1:]:
        wait = rec.marks[s + 1] - rec.marks[s]
        idle = idle_between(rec.marks, device, s, s + 1)
        tail = max(0, device[s] - rec.marks[s])  # the previous step's queued work
        assert idle == pytest.approx(wait - tail, abs=20 * US)
        # The previous step's kernels started when launched (idle device) and ran gpu_ms.
        launched = rec.marks[s] - rec.marks[s - 1]
        assert tail == pytest.approx(gpu_ms * MS - launched, rel=0.1, abs=300 * US)
        assert 0 < idle < wait
        assert idle_between(rec.marks, device, s + 1, s + 2) == 0  # kernels kept it busy


def test_events_non_blocking_pinned_copy_is_device_time():
    torch.cuda.init()
    host = torch.empty(64 * 2**20, dtype=torch.float32).pin_memory()  # 256 MiB
    dst = torch.empty_like(host, device="cuda")
    timer = CudaEventTimer(capacity=64)
    _warm(timer)
    torch.cuda.synchronize()
    rec = Recorder(timer)
    rec()
    dst.copy_(host, non_blocking=True)
    rec()
    device = rec.resolve()
    host_ns = rec.marks[1] - rec.marks[0]
    dev_ns = device[1] - device[0]
    assert dev_ns > 2 * host_ns  # the copy ran after the host moved on
    assert idle_between(rec.marks, device, 0, 1) == 0


def test_events_on_a_user_stream(mats):
    a, b = mats
    timer = CudaEventTimer(capacity=64)
    _warm(timer)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    rec = Recorder(timer)
    with torch.cuda.stream(stream):
        rec()
        for _ in range(5):
            a @ b
        rec()
    device = rec.resolve()
    assert device[1] - device[0] >= rec.marks[1] - rec.marks[0]
    assert device[1] - device[0] == pytest.approx(_matmul_ms(a, b, 5) * MS, rel=0.2)


def test_sync_timer_waits_at_marks(mats):
    a, b = mats
    n = max(2, int(30 / max(_matmul_ms(a, b, 1), 0.05)))
    timer = SyncTimer()
    _warm(timer)
    torch.cuda.synchronize()
    rec = Recorder(timer)
    rec()
    for _ in range(n):
        a @ b
    t = time.perf_counter_ns()
    rec()
    assert rec.marks[1] - t > 15 * MS  # mark() waited for the kernels
    device = rec.resolve()
    assert list(device) == rec.marks
    assert device.arrivals[1] <= t + 1 * MS


def test_auto_mode_becomes_events_once_cuda_is_in_use(mats):
    timer = make_timer("auto")
    assert isinstance(timer, CudaEventTimer)
    assert timer.mark() is not None and timer.mode == "events"
