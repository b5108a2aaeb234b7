"""The live view's cost to the job it watches, measured side by side.

The same instrumented CPU loop (under ``opentelemetry-instrument``, metrics exported
every second as ``otel-training top`` sets them) exports in turn to ``otel-training
top --listen`` (drawing its screen) and to a loopback stand-in for a Collector (the
same OTLP receiver, dropping what it gets); the viewer runs in a pseudo-terminal, drawing its screen as it
would for a person. Rounds alternate, and the ratio printed is the median over rounds
of the loop's own seconds per step, viewer over stand-in.

    .venv/bin/python benchmarks/top_overhead.py [--rounds 8] [--steps 2000]

Target: viewer / stand-in <= 1.02 (the viewer is a separate process: on a machine with
cores to spare it costs the job nothing but the export it already makes).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import textwrap
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
LOOP = textwrap.dedent(
    """
    import sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0); torch.set_num_threads(1)
    steps = int(sys.argv[1])
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64 * steps, 256), torch.randint(0, 4, (64 * steps,)))
    start = None
    for i, (x, y) in enumerate(DataLoader(data, batch_size=64)):
        if i == 50:
            start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    print((time.perf_counter() - start) / (steps - 50))
    """
)
STAND_IN = (
    "import time; from otel_training.live.receiver import Receiver; "
    "Receiver(lambda request: None, '127.0.0.1:{port}', None).start(); time.sleep(10**9)"
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass


def _wait_listening(port: int, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"nothing listens on {port}")


def _loop(script: str, port: int, steps: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_METRIC_EXPORT_INTERVAL="1000",
        OTEL_SERVICE_NAME="top-overhead",
    )
    out = subprocess.run(
        [str(BIN / "opentelemetry-instrument"), str(BIN / "python"), script, str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    viewer_port, stand_in_port = _port(), _port()
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # The viewer in a terminal of its own (a pseudo-terminal, read and dropped): it draws
    # its screen twice a second as it would for a person.
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
    viewer = subprocess.Popen(
        [str(BIN / "otel-training"), "top", "--listen", f"127.0.0.1:{viewer_port}", "--http-listen", "127.0.0.1:0"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=dict(os.environ, TERM="xterm-256color"),
    )
    os.close(slave)
    threading.Thread(target=_drain, args=(master,), daemon=True).start()
    stand_in = subprocess.Popen([str(BIN / "python"), "-c", STAND_IN.format(port=stand_in_port)], **quiet)
    ratios = []
    try:
        _wait_listening(viewer_port)
        _wait_listening(stand_in_port)
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
            fh.write(LOOP)
        for r in range(args.rounds):
            order = [("viewer", viewer_port), ("stand-in", stand_in_port)]
            got = dict((name, _loop(fh.name, port, args.steps)) for name, port in (order if r % 2 else order[::-1]))
            ratios.append(got["viewer"] / got["stand-in"])
            print(
                f"round {r + 1}: viewer {got['viewer'] * 1e3:.3f} ms/step, stand-in {got['stand-in'] * 1e3:.3f} "
                f"ms/step, ratio {ratios[-1]:.3f}",
                flush=True,
            )
    finally:
        for p in (viewer, stand_in):
            p.send_signal(signal.SIGINT)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    print(f"\nviewer / stand-in: {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}; target <= 1.02)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
