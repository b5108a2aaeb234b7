"""Several ranks on one host: host and GPU series come from one process at a time.

Each rank is a real subprocess with its own sampler (fake NVML, one GPU it uses)
sharing one lock file; it prints what its own reader collected every 0.1 s.
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

lock_path, duration = sys.argv[1], float(sys.argv[2])
reader = InMemoryMetricReader()
provider = MeterProvider(metric_readers=[reader])
hw = start_hardware_metrics(provider, Config(hardware_interval=0.05), host_name="shared",
                            lock_path=lock_path)
end = time.monotonic() + duration
while time.monotonic() < end:
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


def _rank(lock_path, duration):
    return subprocess.Popen([sys.executable, "-c", RANK, str(lock_path), str(duration)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _wait_for_host(proc, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if json.loads(line).get("host"):
            return
    raise AssertionError("the first rank never sampled the host")


def _lines(proc, timeout=30.0):
    out, _ = proc.communicate(timeout=timeout)
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize("holder_exit", ["normal", "killed"])
def test_one_sampler_per_host_and_takeover(tmp_path, holder_exit):
    lock = tmp_path / "hw.lock"
    first = _rank(lock, 1.2 if holder_exit == "normal" else 60)
    try:
        _wait_for_host(first)
        second = _rank(lock, 3.5)
        if holder_exit == "killed":
            time.sleep(1.5)
            first.send_signal(signal.SIGKILL)  # no cleanup at all: the kernel frees the lock
        first_lines = _lines(first)
        gone_at = time.time() if holder_exit == "killed" else first_lines[-1]["t"]
        second_lines = _lines(second)
    finally:
        first.kill()
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
                   for s in first_lines[1:] if "exit" not in s)


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
