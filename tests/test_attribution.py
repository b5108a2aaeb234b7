"""GPU idle attribution and GPU-synchronized marks, on a simulated device.

Loops run on ``tests/fake_device.SimDevice`` with the ``OracleTimer`` (exact
completion times) or the real ``SyncTimer``; attribution results are checked
against the simulator's ground truth (the default stream's busy intervals).
"""

from __future__ import annotations

import pytest

from otel_training.aggregate.idle import (
    BUSY_TOLERANCE_NS, idle_between, interval_idle, synchronized_marks,
)
from otel_training.timing.device import DeviceTimes
from otel_training.timing.sync import SyncTimer
from tests.fake_device import MS, US, OracleTimer, SimBackend, SimDevice, SimLoop


# -- pure functions ----------------------------------------------------------------------------

def test_synchronized_marks_without_device_is_host():
    assert synchronized_marks([1, 2, 3], None) == [1, 2, 3]


def test_synchronized_marks_never_before_host_and_monotonic():
    host = [100, 200, 300, 400]
    device = [90, 250, 240, None]
    assert synchronized_marks(host, device) == [100, 250, 300, 400]
    device = [100, 500, 450, 420]  # a later boundary cannot complete before an earlier one
    assert synchronized_marks(host, device) == [100, 500, 500, 500]


def test_interval_idle_work_free_stretch_is_wait_minus_tail():
    # Boundary 0: previous work finishes at 130; the host waits until 200 (no work issued).
    host = [100, 200]
    assert interval_idle(host, [130, 200]) == [70]
    assert interval_idle(host, [250, 250]) == [0]  # still busy past the end: no idle
    assert interval_idle(host, [90, 200]) == [100]  # device already idle at the start


def test_interval_idle_fed_stretch_counts_zero():
    # Work issued in the stretch still runs 1 ms after the host left it.
    host = [0, 100 * US]
    assert interval_idle(host, [0, 100 * US + 1 * MS]) == [0]
    # ... but a tail within the tolerance is "caught up".
    assert interval_idle(host, [0, 100 * US + BUSY_TOLERANCE_NS // 2]) == [100 * US]


def test_interval_idle_unknown_or_unobserved_is_zero():
    assert interval_idle([0, 10, 20], None) == [0, 0]
    assert interval_idle([0, 10, 20], [None, 10, 20]) == [0, 10]
    assert idle_between([0, 10, 20], None, 0, 2) == 0
    assert idle_between([0, 10], [0, 10], 1, 1) == 0


def test_idle_between_is_additive_over_stretches():
    host = [0, 10, 20, 30, 40]
    device = [5, 10, 35, 35, 40]
    per = interval_idle(host, device)
    assert idle_between(host, device, 0, 4) == sum(per)
    assert idle_between(host, device, 0, 2) + idle_between(host, device, 2, 4) == sum(per)


def test_idle_between_reads_arrivals_from_device_times():
    # Sync mode: the host reached boundary 1 at 0.7 ms and waited until 1 ms.
    host = [0, 1 * MS]
    busy = DeviceTimes([0, 1 * MS], arrivals=[0, 700 * US])
    assert idle_between(host, busy, 0, 1) == 0
    idle = DeviceTimes([0, 1 * MS], arrivals=[0, 990 * US])
    assert idle_between(host, idle, 0, 1) == 1 * MS
    assert idle_between(host, [0, 1 * MS], 0, 1, arrivals=[0, 700 * US]) == 0


# -- simulated loops ---------------------------------------------------------------------------

def _train_step(loop: SimLoop, *, loader_ns, copy_ns=500 * US, pinned=True, fwd=(10, 1 * MS),
                bwd=(20, 1 * MS), opt=(5, 200 * US), item=True, launch_host_ns=None):
    dev = loop.device
    loop.begin_step()
    with loop.phase("dataloader_next"):
        dev.clock.advance(loader_ns)
    with loop.phase("to_device"):
        dev.copy_h2d(copy_ns, non_blocking=True, pinned=pinned)
    with loop.phase("train_batch"):
        for name, (n, ns) in (("forward", fwd), ("backward", bwd), ("optimizer_step", opt)):
            with loop.phase(name):
                for _ in range(n):
                    dev.launch(ns, host_ns=launch_host_ns)
    if item:
        with loop.phase("from_device"):
            dev.item()


def _run(timer_for, steps=6, **kw):
    dev = SimDevice()
    loop = SimLoop(dev, timer_for(dev))
    for _ in range(steps):
        _train_step(loop, **kw)
    loop.end()
    return dev, loop


def _attributed(loop, step):
    device = loop.timer.resolve(step.marks, step.tokens)
    idle = {}
    for rec in step.phases:
        if rec.outer is None:
            idle[rec.name] = idle.get(rec.name, 0) + idle_between(step.marks, device, rec.start, rec.end)
    return device, idle


def _truth(dev, step, name):
    total = 0
    for rec in step.phases:
        if rec.name == name and rec.outer is None:
            total += dev.idle_ns(step.marks[rec.start], step.marks[rec.end])
    return total


def test_data_bound_idle_is_dataloader_wait_minus_previous_tail():
    # 60 ms loader waits, ~36 ms of GPU work per step, no per-step sync: the previous
    # step's queued work overlaps the start of the next wait.
    dev, loop = _run(OracleTimer, loader_ns=60 * MS, item=False)
    for step in loop.steps[1:]:
        device, idle = _attributed(loop, step)
        truth = _truth(dev, step, "dataloader_next")
        assert truth > 20 * MS  # the scenario really is data-bound
        assert idle["dataloader_next"] == pytest.approx(truth, abs=10 * US)
        # The tail of the previous step is not idle: less than the whole wait.
        rec = step.phases[0]
        wait = step.marks[rec.end] - step.marks[rec.start]
        assert idle["dataloader_next"] < wait - 20 * MS
        # The GPU work phases kept the device fed.
        assert idle["train_batch"] == 0 and idle["to_device"] == 0


def test_gpu_bound_loop_idle_is_near_zero():
    # 0.1 ms loader, ~36 ms of GPU work launched in well under that; .item() each step.
    dev, loop = _run(OracleTimer, loader_ns=100 * US)
    for step in loop.steps[1:]:
        device, idle = _attributed(loop, step)
        step_ns = step.marks[-1] - step.marks[0]
        total = sum(idle.values())
        assert total < 0.01 * step_ns
        assert idle["train_batch"] == 0
        # The device really does sit idle while the next batch is fetched after .item().
        assert idle["dataloader_next"] == pytest.approx(_truth(dev, step, "dataloader_next"), abs=10 * US)


def test_gpu_bound_loop_without_sync_has_no_idle():
    dev, loop = _run(OracleTimer, loader_ns=100 * US, item=False)
    for step in loop.steps[1:]:
        _, idle = _attributed(loop, step)
        assert sum(idle.values()) == 0


def test_host_bound_launch_loop_attributes_idle_to_launching_phases():
    # Kernels of 10 us launched every 100 us: the device idles ~90% of forward/backward.
    dev, loop = _run(OracleTimer, loader_ns=100 * US, fwd=(100, 10 * US), bwd=(100, 10 * US),
                     opt=(20, 10 * US), launch_host_ns=100 * US, copy_ns=20 * US)
    for step in loop.steps[1:]:
        _, idle = _attributed(loop, step)
        truth = _truth(dev, step, "train_batch")
        rec = next(r for r in step.phases if r.name == "train_batch")
        host = step.marks[rec.end] - step.marks[rec.start]
        device_work = 220 * 10 * US
        assert truth > 0.8 * host
        # An upper bound, off by at most the phase's own (small) kernels.
        assert truth <= idle["train_batch"] <= truth + device_work
        assert idle["train_batch"] <= host


def test_non_blocking_pinned_copy_keeps_device_fed():
    dev, loop = _run(OracleTimer, loader_ns=100 * US, copy_ns=2 * MS, pinned=True)
    for step in loop.steps[1:]:
        _, idle = _attributed(loop, step)
        assert idle["to_device"] == 0
        assert _truth(dev, step, "to_device") < BUSY_TOLERANCE_NS


def test_pageable_copy_wait_counts_as_idle_upper_bound():
    # A copy the host waits for inside to_device: boundary events cannot see inside
    # the stretch, so its time is counted (an upper bound, documented).
    dev, loop = _run(OracleTimer, loader_ns=100 * US, copy_ns=2 * MS, pinned=False)
    for step in loop.steps[1:]:
        _, idle = _attributed(loop, step)
        rec = next(r for r in step.phases if r.name == "to_device")
        host = step.marks[rec.end] - step.marks[rec.start]
        assert idle["to_device"] == pytest.approx(host, abs=1 * US)
        assert _truth(dev, step, "to_device") <= idle["to_device"]


def test_mixed_loop_attributes_to_dataloader_and_sums_consistently():
    # Loader and GPU time comparable: idle appears only where the device ran dry.
    dev, loop = _run(OracleTimer, loader_ns=30 * MS, item=False)
    for step in loop.steps[2:]:
        device, idle = _attributed(loop, step)
        whole = idle_between(step.marks, device, 0, len(step.marks) - 1)
        assert whole >= sum(idle.values())  # phases + gaps add up to the step
        assert idle["dataloader_next"] == pytest.approx(_truth(dev, step, "dataloader_next"), abs=10 * US)


def test_sync_mode_idle_uses_arrivals():
    # sync mode: every boundary drains the device; idle appears only where the host
    # reached a boundary with nothing queued (the loader wait), not in GPU phases.
    dev = SimDevice()
    loop = SimLoop(dev, SyncTimer(backend=SimBackend(dev), clock=dev.clock))
    for _ in range(4):
        _train_step(loop, loader_ns=5 * MS)
    loop.end()
    for step in loop.steps[1:]:
        device = loop.timer.resolve(step.marks, step.tokens)
        assert list(device) == step.marks  # device = host
        idle = {r.name: idle_between(step.marks, device, r.start, r.end) for r in step.phases if r.outer is None}
        rec = step.phases[0]
        assert idle["dataloader_next"] == pytest.approx(step.marks[rec.end] - step.marks[rec.start], abs=2 * US)
        assert idle["train_batch"] == 0
        # Without arrivals the same lists would claim the whole step idle.
        assert idle_between(step.marks, list(device), 0, len(step.marks) - 1) == step.marks[-1] - step.marks[0]
