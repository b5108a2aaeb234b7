"""``otel-training top``: watch a run while it trains, from the OTLP it already sends.

    otel-training top -- python train.py        # launch: run it instrumented, watch it
    otel-training top -- torchrun --nproc-per-node 2 train.py
    otel-training top --listen 127.0.0.1:4317   # attach: an OTLP receiver any job points at

Launch mode runs the command under ``opentelemetry-instrument`` with its OTLP sent to
the viewer every second (``OTEL_METRIC_EXPORT_INTERVAL=1000``) and its output written
to a file, so the viewer quitting or dying never stops or slows the job: it only
loses its telemetry (one line about a failed export). Attach mode listens for
OTLP/gRPC on ``--listen`` and OTLP/HTTP on ``--http-listen``, as a Collector's ``otlp``
receiver does (the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``, or a Collector's exporter).
Keys: 1, 2, 3 (or tab) switch views; q quits.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from otel_training.live.report import heat, live_report, median_interval, step_times
from otel_training.live.screen import VIEWS, WINDOW_EXPORTS, Frame, screen
from otel_training.live.state import LiveRun

REFRESH_S = 0.5  # the screen is redrawn twice a second


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="otel-training top",
        description="Watch a training run live: step time, phase shares, throughput, memory, hardware, "
        "goodput, the verdict so far and the ranks, from the OTLP the job sends.",
        epilog="launch: otel-training top -- python train.py; attach: otel-training top --listen 127.0.0.1:4317",
    )
    p.add_argument("--listen", metavar="HOST:PORT", help="attach mode: OTLP/gRPC address (default 127.0.0.1:4317)")
    p.add_argument(
        "--http-listen", metavar="HOST:PORT", help="attach mode: OTLP/HTTP address (default: the gRPC port + 1)"
    )
    p.add_argument("--output", metavar="FILE", help="launch mode: the job's stdout and stderr (default: a temp file)")
    p.add_argument("--view", choices=VIEWS, default=VIEWS[0], help="the view shown first")
    p.add_argument(
        "--web",
        metavar="HOST:PORT",
        help="also serve the run as the HTML report's page, reloaded every 2 s (e.g. 127.0.0.1:8050)",
    )
    p.add_argument("--no-wait", action="store_true", help="launch mode: exit when the job ends (no key to press)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="launch mode: -- COMMAND [ARGS]")
    return p


def _address(text: str, option: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SystemExit(f"otel-training top: {option} {text!r} is not HOST:PORT (e.g. 127.0.0.1:4317)")
    return host or "127.0.0.1", int(port)


def _instrument() -> str | None:
    """``opentelemetry-instrument`` beside this Python, or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    return here if os.access(here, os.X_OK) else shutil.which("opentelemetry-instrument")


class Keys:
    """Single keys from the terminal (cbreak mode: Ctrl-C still interrupts)."""

    def __init__(self) -> None:
        self.pressed: list[str] = []
        self._old: Any = None
        self._stop = threading.Event()
        if not sys.stdin.isatty():
            return
        import termios
        import tty

        fd = sys.stdin.fileno()
        self._old = termios.tcgetattr(fd)
        tty.setcbreak(fd)
        threading.Thread(target=self._read, name="otel-training-top-keys", daemon=True).start()

    def _read(self) -> None:
        fd = sys.stdin.fileno()
        while not self._stop.is_set():
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                ch = os.read(fd, 1).decode(errors="ignore")
                if ch:
                    self.pressed.append(ch)

    def take(self) -> list[str]:
        out, self.pressed = self.pressed, []
        return out

    def close(self) -> None:
        self._stop.set()
        if self._old is not None:
            import termios

            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, self._old)


def _launch(command: list[str], port: int, output: str) -> subprocess.Popen:
    instrument = _instrument()
    if instrument is None:
        raise SystemExit("otel-training top: opentelemetry-instrument is not installed (pip install otel-training)")
    env = dict(os.environ)
    for key in list(env):  # the viewer is the job's only OTLP destination
        if key.startswith("OTEL_EXPORTER_OTLP_") and key.endswith(("ENDPOINT", "PROTOCOL")):
            del env[key]
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_METRIC_EXPORT_INTERVAL="1000",
    )
    env.setdefault("OTEL_SERVICE_NAME", os.path.basename(command[-1]).rsplit(".", 1)[0] or "train")
    with open(output, "ab") as out:  # a file, not a pipe: the job never blocks on the viewer
        return subprocess.Popen([instrument, *command], env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)


def _tail(path: str | None, lines: int = 12) -> tuple[str, ...]:
    """The last ``lines`` lines of the job's output file."""
    if not path:
        return ()
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 8192))
            text = fh.read().decode(errors="replace")
    except OSError:
        return ()
    return tuple(text.splitlines()[-lines:])


def frame(run: LiveRun, source: str, job_status: str | None, output: str | None = None) -> Frame:
    report = live_report(run)
    mode = report.mode or next(iter(report.modes_with_steps()), None) or "train"
    return Frame(
        run=report,
        last=live_report(run, last=WINDOW_EXPORTS),
        steps=step_times(run, mode, last=WINDOW_EXPORTS),
        processes=run.ordered(),
        heat=heat(run, mode),
        interval_s=median_interval(run),
        source=source,
        job_status=job_status,
        # while the job shows no steps (starting, or failed before its first), what it printed
        job_tail=_tail(output) if output and not report.modes else (),
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    from otel_training.live.receiver import Receiver

    run = LiveRun()
    if command:
        receiver = Receiver(run.add, "127.0.0.1:0", None)
    else:
        host, port = _address(args.listen or "127.0.0.1:4317", "--listen")
        http = args.http_listen or f"{host}:{port + 1 if port else 0}"
        _address(http, "--http-listen")
        receiver = Receiver(run.add, f"{host}:{port}", http)
    web = None
    try:
        receiver.start()
        if args.web:
            from otel_training.live.web import WebView

            _address(args.web, "--web")
            web = WebView(run, args.web)
    except OSError as exc:
        receiver.stop()
        print(f"otel-training top: {exc}", file=sys.stderr)
        return 2
    job = None
    output = args.output
    if command:
        if output is None:
            fd, output = tempfile.mkstemp(prefix="otel-training-top-", suffix=".log")
            os.close(fd)
        job = _launch(command, receiver.grpc_port or 0, output)
        source = f"launched: {' '.join(command)} (output: {output})"
    else:
        source = f"listening: {receiver.where()}"
    if web is not None:
        source += f" · page: {web.url}"
    try:
        return _show(run, source, job, args, output)
    finally:
        receiver.stop()
        if web is not None:
            web.stop()
        if job is not None and job.poll() is None:
            print(f"otel-training top: the job goes on (pid {job.pid}); its output: {output}", file=sys.stderr)
        elif output:
            print(f"otel-training top: the job's output: {output}", file=sys.stderr)


def _show(run: LiveRun, source: str, job: subprocess.Popen | None, args: argparse.Namespace, output: str | None) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    view = args.view

    def stop(signum: int, _frame: Any) -> None:  # the terminal is given back as it was
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    keys = Keys()
    ended_at: float | None = None
    try:
        with Live(console=console, screen=console.is_terminal, auto_refresh=False) as live:
            while True:
                code = job.poll() if job is not None else None
                status = None if job is None else ("running" if code is None else f"ended (exit {code})")
                if code is not None and ended_at is None:
                    ended_at = time.monotonic()
                    run.job_ended(code)
                live.update(screen(frame(run, source, status, output), view), refresh=True)
                for ch in keys.take():
                    if ch in "qQ":
                        return code if code is not None else 0
                    if ch in "123":
                        view = VIEWS[int(ch) - 1]
                    elif ch == "\t":
                        view = VIEWS[(VIEWS.index(view) + 1) % len(VIEWS)]
                if ended_at is not None and (args.no_wait or not sys.stdin.isatty()):
                    if time.monotonic() - ended_at >= REFRESH_S:  # (one frame showing the end)
                        return code or 0
                time.sleep(REFRESH_S)
    except KeyboardInterrupt:  # the terminal's Ctrl-C reached the job too: its status
        if job is not None:
            try:
                return job.wait(10)
            except subprocess.TimeoutExpired:
                return 130
        return 130
    finally:
        keys.close()
