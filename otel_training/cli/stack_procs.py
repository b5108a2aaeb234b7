"""``stack up``, ``stack status`` and ``stack down``: the plan's services as background
processes, each in a session of its own, with a pid file in ``DIR/.stack`` and one log
in ``DIR/logs``. A pid file names the process' start time too, so a reused pid is never
signalled. ``up`` starts the services in dependency order and waits for each as its
compose healthcheck says; if one fails, what this ``up`` started is stopped again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_training.cli.stack_plan import HOST, LOGS, STATE, Plan, Service

# Names a binary may have, in the order looked for.
PROGRAMS = {
    "otelcol": ("otelcol", "otelcol-training", "otelcol-contrib"),
    "prometheus": ("prometheus",),
    "alertmanager": ("alertmanager", "prometheus-alertmanager"),
    "jaeger": ("jaeger",),
}
STOP_WAIT_S = 15.0


class StackError(RuntimeError):
    """``up`` or ``down`` could not do what was asked: the message says why."""


def built_bin_dir() -> Path:
    """Where scripts/install-stack.sh links what it built (its cache, outside any clone)."""
    cache = os.environ.get("OTEL_TRAINING_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "otel-training"
    )
    return Path(cache) / "stack" / "bin"


def find_binaries(bin_dir: Path | None, names: set[str]) -> dict[str, str]:
    """Program name -> path, from ``bin_dir``, or else PATH and then what
    scripts/install-stack.sh built; a missing one is an error."""
    found, missing = {}, []
    bin_dir = bin_dir.resolve() if bin_dir else None  # services start in the stack directory
    search = str(bin_dir) if bin_dir else os.pathsep.join([os.environ.get("PATH", ""), str(built_bin_dir())])
    for name in sorted(names):
        for candidate in PROGRAMS.get(name, (name,)):
            path = shutil.which(candidate, path=search)
            if path:
                found[name] = os.path.abspath(path)
                break
        else:
            missing.append(name)
    if missing:
        where = f"in {bin_dir}" if bin_dir else f"on PATH or in {built_bin_dir()}"
        raise StackError(
            f"no {', '.join(missing)} {where}: scripts/install-stack.sh builds them "
            "(or take release binaries: docs/stack.md, 'Without Docker'); give their folder with --bin-dir"
        )
    return found


def _start_time(pid: int) -> str | None:
    """The process' start time in clock ticks since boot (``/proc/PID/stat`` field 22);
    None when it is gone or has exited (a zombie that nobody has reaped yet: a service
    outlives `stack up`, so its parent is whatever adopted it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


@dataclass(frozen=True)
class Running:
    pid: int
    started: str
    program: str


def _pid_file(plan: Plan, name: str) -> Path:
    return plan.directory / STATE / f"{name}.pid"


def running(plan: Plan, name: str) -> Running | None:
    """The service's process, if its pid file names one that is still the same process."""
    try:
        data = json.loads(_pid_file(plan, name).read_text())
        proc = Running(int(data["pid"]), str(data["started"]), str(data["program"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return proc if _start_time(proc.pid) == proc.started else None


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def _healthy(service: Service) -> bool:
    if service.health is None:
        return all(_listening(p) for p in service.ports)
    try:
        with urllib.request.urlopen(service.health, timeout=2) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _spawn(plan: Plan, service: Service, binary: str) -> subprocess.Popen[bytes]:
    log_path = plan.directory / LOGS / f"{service.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **service.env}
    with open(log_path, "ab") as log:
        log.write(f"--- otel-training stack up: {binary} {' '.join(service.args)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                [binary, *service.args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=plan.directory,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            raise StackError(f"{service.name}: cannot run {binary}: {exc.strerror or exc}") from None
    started = _start_time(proc.pid) or ""
    _pid_file(plan, service.name).write_text(json.dumps({"pid": proc.pid, "started": started, "program": binary}))
    return proc


def _wait_healthy(plan: Plan, service: Service, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + service.wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(f"{service.name} exited at start:\n{_tail(plan.directory / LOGS / f'{service.name}.log')}")
        if _healthy(service):
            return
        time.sleep(0.2)
    raise StackError(
        f"{service.name} was not healthy within {service.wait_s:.0f} s "
        f"({service.health or 'its ports'}):\n{_tail(plan.directory / LOGS / f'{service.name}.log')}"
    )


def _stop(plan: Plan, name: str) -> bool:
    """SIGTERM the service's process group, SIGKILL after STOP_WAIT_S; True if one ran."""
    proc = running(plan, name)
    _pid_file(plan, name).unlink(missing_ok=True)
    if proc is None:
        return False
    for sig, wait in ((signal.SIGTERM, STOP_WAIT_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _start_time(proc.pid) == proc.started:
            _reap(proc.pid)
            time.sleep(0.1)
        if _start_time(proc.pid) != proc.started:
            return True
    return True


def _reap(pid: int) -> None:
    """Collect our own child's exit status (a zombie keeps its /proc entry)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _order(plan: Plan) -> list[Service]:
    done: list[Service] = []
    pending = list(plan.services)
    while pending:
        ready = [s for s in pending if all(d in {x.name for x in done} for d in s.after)]
        if not ready:  # a cycle or a missing dependency: start the rest in file order
            ready = pending[:1]
        for s in ready:
            pending.remove(s)
            done.append(s)
    return done


def up(plan: Plan, bin_dir: Path | None, say: Callable[[str], None]) -> None:
    """Start every service not already running; on any failure stop what was started."""
    binaries = find_binaries(bin_dir, {s.program for s in plan.services})
    (plan.directory / STATE).mkdir(parents=True, exist_ok=True)
    for path, text in plan.derived.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    started: list[str] = []
    try:
        for service in _order(plan):
            if running(plan, service.name):
                say(f"{service.name}: already running ({service.url})")
                continue
            taken = [p for p in service.ports if _listening(p)]
            if taken:
                raise StackError(
                    f"{service.name}: port {', '.join(map(str, taken))} on {HOST} is taken by another process: "
                    "set the port's variable (docs/stack.md, 'Without Docker') or stop that process"
                )
            proc = _spawn(plan, service, binaries[service.program])
            started.append(service.name)
            _wait_healthy(plan, service, proc)
            say(f"{service.name}: up ({service.url}{'; ' + service.note if service.note else ''})")
    except BaseException:
        for name in reversed(started):
            _stop(plan, name)
        raise
    for skipped in plan.skipped:
        say(f"{skipped.name}: {skipped.why}")


def down(plan: Plan, say: Callable[[str], None]) -> int:
    """Stop every service, the Collector first (it flushes to the others); the count stopped."""
    stopped = 0
    for service in reversed(_order(plan)):
        if _stop(plan, service.name):
            stopped += 1
            say(f"{service.name}: stopped")
    return stopped


def status(plan: Plan) -> dict[str, Any]:
    """Each service's state (``healthy``, ``starting``, ``stopped``, ``not started``), URL,
    pid, log and program."""
    out: dict[str, Any] = {"directory": str(plan.directory), "services": {}}
    for service in plan.services:
        proc = running(plan, service.name)
        state = "stopped" if proc is None else "healthy" if _healthy(service) else "unhealthy"
        out["services"][service.name] = {
            "state": state,
            "url": service.url,
            "pid": proc.pid if proc else None,
            "program": proc.program if proc else service.program,
            "log": str(plan.directory / LOGS / f"{service.name}.log"),
            **({"note": service.note} if service.note else {}),
        }
    for skipped in plan.skipped:
        out["services"][skipped.name] = {"state": "not started", "url": None, "pid": None, "note": skipped.why}
    return out
