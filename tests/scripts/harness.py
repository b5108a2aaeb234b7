"""Run the scripts in this folder as real processes under ``opentelemetry-instrument``,
the way users run training, and watch them from outside (stdout markers with
timestamps, exit status and time, stderr)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent

# stderr lines that are not ours and say nothing about the run: with
# opentelemetry-distro installed too, the auto-instrumentation names the configurator
# it did not load.
NOISE = ("Configuration of ",)


def otel_env(endpoint: Optional[str], tmp: Optional[Path] = None, **extra: str) -> Dict[str, str]:
    """The environment of an instrumented run exporting to ``endpoint``.

    ``tmp`` becomes TMPDIR: the per-host hardware lock lives there, so concurrent test
    runs on one machine do not take it from each other."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("OTEL_") or k in ("PYTHONPATH", "TORCHELASTIC_RUN_ID"))}
    env.update({
        "OTEL_PYTHON_DISTRO": "otel_training",
        "OTEL_PYTHON_CONFIGURATOR": "otel_training",
        "OTEL_SERVICE_NAME": "reliability",
        "PYTHONUNBUFFERED": "1",
    })
    if endpoint is not None:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    # Attempt records of runs with a fixed run id stay in the test's folder (none without
    # one): a rerun of the suite is no restart of its runs.
    env["OTEL_TRAINING_ATTEMPTS_DIR"] = str(tmp / "attempts") if tmp is not None else "none"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def instrumented(script: str, *args: str) -> List[str]:
    return [str(BIN / "opentelemetry-instrument"), sys.executable, str(SCRIPTS / script), *args]


def plain(script: str, *args: str) -> List[str]:
    return [sys.executable, str(SCRIPTS / script), *args]


class Run:
    """A started process; stdout lines are timestamped as they arrive."""

    def __init__(self, cmd: List[str], env: Dict[str, str], cwd: Path = ROOT) -> None:
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: List[tuple] = []  # (arrival time, line)
        self._cond = threading.Condition()
        self._err: List[str] = []
        self._out_thread = threading.Thread(target=self._read_out, daemon=True)
        self._err_thread = threading.Thread(target=self._read_err, daemon=True)
        self._out_thread.start()
        self._err_thread.start()
        self.exited_at: Optional[float] = None

    def _read_out(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append((time.time(), line.rstrip("\n")))
                self._cond.notify_all()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self._err.append(line)

    def wait_for_line(self, prefix: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for _, line in self.lines:
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"no {prefix!r} line from {self.cmd}\nstderr:\n{self.stderr}")
                self._cond.wait(min(left, 0.05))

    def wait(self, timeout: float = 120.0) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(self.proc)
            raise AssertionError(f"{self.cmd} did not exit within {timeout} s\nstderr:\n{self.stderr}")
        self.exited_at = time.time()
        self._out_thread.join(5)
        self._err_thread.join(5)
        return rc

    @property
    def stdout(self) -> str:
        return "\n".join(line for _, line in self.lines)

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def stderr_lines(self) -> List[str]:
        """stderr without the known noise of other packages."""
        return [ln.rstrip("\n") for ln in self._err if ln.strip() and not ln.startswith(NOISE)]

    def marker(self, name: str) -> List[str]:
        """The fields after ``name`` on its stdout line."""
        return self.wait_for_line(name, timeout=0).split()[1:]

    def exit_latency(self) -> float:
        """Seconds from the script's ``TRAINING_END`` (its own clock) to the process exit."""
        end = float(self.marker("TRAINING_END")[0])
        assert self.exited_at is not None
        return self.exited_at - end


def run(cmd: List[str], env: Dict[str, str], timeout: float = 120.0) -> Run:
    r = Run(cmd, env)
    r.wait(timeout)
    return r


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill a process that did not exit and its children (torchrun's ranks): left
    running, they would load the machine under every later test."""
    try:
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        children = []
    proc.kill()
    for child in children:
        try:
            child.kill()
        except Exception:
            pass
    proc.wait()
