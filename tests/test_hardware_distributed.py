"""Several ranks on one host: host and GPU series come from one process at a time.

Each rank is a real subprocess with its own sampler (fake NVML, one GPU it uses)
sharing one lock file; it prints what its own reader collected every 0.1 s until its
stop file appears. The test moves on when the ranks' own lines say so (sampling, taken
over), never after a fixed time: on a loaded machine a rank's start-up alone takes
seconds.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otel_training.hardware.agent_lock import HostLock, default_lock_path

ROOT = Path(__file__).resolve().parents[1]

RANK = r"""
import json, os, sys, time
from tests import fake_pynvml
fake_pynvml.install()
gpu = fake_pynvml.FakeGpu(0)
gpu.processes = [(os.getpid(), 2**30)]
fake_pynvml.configure([gpu])
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from otel_training.config import Config
from otel_training.hardware import start_hardware_metrics

lock_path, stop_path, duration = sys.argv[1], sys.argv[2], float(sys.argv[3])
reader = InMemoryMetricReader()
provider = MeterProvider(metric_readers=[reader])
hw = start_hardware_metrics(provider, Config(hardware_interval=0.05), host_name="shared",
                            lock_path=lock_path)
end = time.monotonic() + duration
while time.monotonic() < end and not os.path.exists(stop_path):
    time.sleep(0.1)
    data = reader.get_metrics_data()
    names = {m.name for rm in (data.resource_metrics if data else []) for sm in rm.scope_metrics
             for m in sm.metrics if m.data.data_points}
    print(json.dumps({"t": time.time(), "host": "system.linux.memory.available" in names,
                      "gpu": "hw.gpu.memory.usage" in names,
                      "process": "process.gpu.memory.usage" in names}), flush=True)
hw.shutdown()
print(json.dumps({"t": time.time(), "exit": True}), flush=True)
"""


def _rank(lock_path, stop_path, duration=120.0):
    return subprocess.Popen([sys.executable, "-c", RANK, str(lock_path), str(stop_path), str(duration)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _read_until(proc, done, timeout=90.0) -> list:
    """The rank's lines up to the first for which ``done(lines so far)`` holds."""
    lines = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(json.loads(line))
        if done(lines):
            return lines
    raise AssertionError(f"the rank never got there; its lines: {lines[-5:]}")


def _rest(proc, timeout=90.0) -> list:
    out, _ = proc.communicate(timeout=timeout)
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize("holder_exit", ["normal", "killed"])
def test_one_sampler_per_host_and_takeover(tmp_path, holder_exit):
    lock = tmp_path / "hw.lock"
    stop_first, stop_second = tmp_path / "stop-first", tmp_path / "stop-second"
    first = _rank(lock, stop_first)
    second = None
    try:
        _read_until(first, lambda lines: lines[-1].get("host"))
        second = _rank(lock, stop_second)
        # the second rank samples (its own process) while the first holds the host
        second_lines = _read_until(second, lambda lines: len(lines) >= 4)
        if holder_exit == "killed":
            first.send_signal(signal.SIGKILL)  # no cleanup at all: the kernel frees the lock
        else:
            stop_first.touch()
        first_lines = _rest(first)
        gone_at = time.time() if holder_exit == "killed" else first_lines[-1]["t"]
        # until it has sampled the host for a while after the first rank went
        second_lines += _read_until(second, lambda lines: sum(s["t"] > gone_at + 0.5 for s in lines) >= 5)
        stop_second.touch()
        second_lines += _rest(second)
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait(30)
    samples = [s for s in second_lines if "exit" not in s]
    before = [s for s in samples if s["t"] < gone_at - 0.05]
    after = [s for s in samples if s["t"] > gone_at + 0.5]
    assert before and after
    # while the first rank held the host, the second sampled only its own process
    assert not any(s["host"] or s["gpu"] for s in before)
    assert all(s["process"] for s in samples[2:])
    # then it took over host and GPU sampling
    assert all(s["host"] and s["gpu"] for s in after)
    if holder_exit == "normal":
        assert all(s["host"] and s["gpu"] and s["process"]
                   for s in first_lines if "exit" not in s)


def test_lock_is_exclusive_and_freed_on_release(tmp_path):
    path = str(tmp_path / "hw.lock")
    a, b = HostLock(path), HostLock(path)
    assert a.try_acquire()
    assert not b.try_acquire()  # flock is per open file: exclusive even in one process
    assert not b.held
    a.release()
    assert b.try_acquire() and b.held
    b.release()


def test_default_lock_is_per_user_in_the_temp_dir():
    path = default_lock_path()
    import tempfile
    assert os.path.dirname(path) == tempfile.gettempdir()
    assert str(os.getuid()) in os.path.basename(path)


def test_forked_child_does_not_keep_the_lock(tmp_path):
    path = str(tmp_path / "hw.lock")
    lock = HostLock(path)
    assert lock.try_acquire()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader-style worker that outlives the lock holder's release
        os.write(ready_w, b"x")  # the at-fork handlers have run by now
        time.sleep(0.5)
        os._exit(0)
    try:
        os.read(ready_r, 1)
        lock.release()
        other = HostLock(path)
        assert other.try_acquire()  # the child's inherited descriptor does not hold it
        other.release()
    finally:
        os.waitpid(pid, 0)
