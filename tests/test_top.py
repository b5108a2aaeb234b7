"""``otel-training top``: the live numbers against the run's own summary, over real
OTLP (gRPC and HTTP) from real instrumented loops; the view driven in a real terminal
(tmux: ``send-keys``, ``capture-pane``) in launch mode, for one process and for two
ranks under torchrun; the viewer killed mid-run; its memory over a replayed hour."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from otel_training.live.receiver import Receiver
from otel_training.live.report import live_report
from otel_training.live.state import LiveRun
from tests.fake_pynvml import fake_nvml  # noqa: F401 (fixture)
from tests.otlp_receiver import free_port
from tests.scripts.harness import BIN, ROOT, SCRIPTS

pytestmark = [pytest.mark.slow, pytest.mark.sdk_independent]

TMUX = shutil.which("tmux")
FETCH_MS = 30.0  # the loop's planted data delay per batch


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "_OTEL_TRAINING"))}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        OTEL_SERVICE_NAME="top-test",
        OTEL_TRAINING_SUMMARY_FILE=str(tmp / "summary.json"),
        GLOO_SOCKET_IFNAME="lo",
    )
    env.update(extra)
    return env


def _loop(steps: int) -> list[str]:
    return [str(BIN / "python"), str(SCRIPTS / "train_top.py"), "--steps", str(steps), "--fetch-ms", str(FETCH_MS)]


def _shares(summary: dict, mode: str = "train") -> dict[str, float]:
    return {p["name"]: p["share"] for p in summary["modes"][mode]["phases"] if p["parent"] == "step"}


# -- the numbers ---------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_live_run_ends_with_the_summarys_numbers(tmp_path, protocol):
    """A loop exporting to the viewer's receiver: at its end, the viewer's step count is
    the summary's and each phase's share the summary's, up to the weight of one step
    (the summary's phase totals leave out the FLOP-count step, the metrics keep it)."""
    run = LiveRun()
    receiver = Receiver(run.add, "127.0.0.1:0", "127.0.0.1:0").start()
    try:
        port = receiver.grpc_port if protocol == "grpc" else receiver.http_port
        env = _env(
            tmp_path,
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
            OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
            OTEL_METRIC_EXPORT_INTERVAL="1000",
        )
        r = subprocess.run([str(BIN / "opentelemetry-instrument"), *_loop(40)], env=env, capture_output=True,
                           text=True, timeout=240)
    finally:
        receiver.stop()
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    report = live_report(run)
    live = report.modes["train"]
    assert live.steps == summary["modes"]["train"]["steps"] == 40, (live.steps, summary["modes"]["train"]["steps"])
    assert receiver.requests >= 1 and receiver.failed == 0
    want = _shares(summary)
    got = {p.name: p.share for p in live.top_phases()}
    assert max(got, key=got.__getitem__) == "dataloader_next" == max(want, key=want.__getitem__), (got, want)
    m = summary["modes"]["train"]
    one_step = m["step_max_s"] / m["step_time_s"] + 0.002
    off = {n: (got.get(n, 0.0), s) for n, s in want.items() if abs(got.get(n, 0.0) - s) > one_step}
    assert not off, f"live share vs summary share: {off}"
    assert report.first_finding() is not None and report.first_finding().kind == "data_loading"


# -- in a real terminal ----------------------------------------------------------------------
class Pane:
    """A tmux session of its own (its own server socket) running ``command``."""

    def __init__(self, tmp: Path, command: list[str], env: dict[str, str], width: int = 150, height: int = 60):
        if TMUX is None:
            if os.environ.get("CI") == "true":
                pytest.fail("tmux is not installed (scripts/install-tmux.sh)")
            pytest.skip("tmux is not installed (bash scripts/install-tmux.sh)")
        self.socket, self.name = str(tmp / "tmux.sock"), f"top-{uuid.uuid4().hex[:8]}"
        self.status = tmp / "status"
        line = " ".join(_quote(c) for c in command) + f"; echo $? > {_quote(str(self.status))}; sleep 600"
        self._tmux("new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height), line, env=env)

    def _tmux(self, *args: str, env: dict[str, str] | None = None) -> str:
        return subprocess.run([TMUX, "-S", self.socket, *args], env=env, capture_output=True, text=True,
                              timeout=30, check=True).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", self.name)

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", self.name, *keys)

    def wait(self, predicate, timeout: float, every: float = 0.1) -> str:
        end = time.monotonic() + timeout
        while True:
            text = self.screen()
            if predicate(text):
                return text
            if time.monotonic() > end:
                raise AssertionError(f"not on the screen within {timeout:.0f} s:\n{text}")
            time.sleep(every)

    def close(self) -> None:
        subprocess.run([TMUX, "-S", self.socket, "kill-server"], capture_output=True, timeout=30)


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _phase_rows(text: str) -> list[list[str]]:
    """The phase table's rows, largest first: [name, last, run, ms/step]."""
    lines = text.splitlines()
    at = next((i for i, ln in enumerate(lines) if "phases (share of step time)" in ln), None)
    if at is None:
        return []
    start = next((i for i in range(at, len(lines)) if "┡" in lines[i]), None)
    rows = []
    for ln in lines[(start or len(lines)) + 1:]:
        if "└" in ln:
            break
        cells = [c.strip() for c in ln.split("│") if c.strip()]
        if len(cells) == 4:
            rows.append(cells)
    return rows


def _largest(text: str) -> str | None:
    rows = _phase_rows(text)
    return rows[0][0] if rows else None


def test_top_names_the_slow_loader_within_3_s_of_the_first_step(tmp_path):
    """Launch mode in tmux: within 3 s of the loop's first step (its own clock) the
    largest phase on the screen is dataloader_next; at the end its run share is within
    5 points of the summary's; keys switch views; q quits with the job's status."""
    out = tmp_path / "job.log"
    pane = Pane(tmp_path, [str(BIN / "otel-training"), "top", "--output", str(out), "--", *_loop(150)], _env(tmp_path))
    try:
        pane.wait(lambda t: _largest(t) == "dataloader_next", timeout=120, every=0.05)
        shown = time.time()
        first = next(float(ln.split()[2]) for ln in out.read_text().splitlines() if ln.startswith("first step "))
        print(f"dataloader_next the largest on the screen {shown - first:.2f} s after the first step")
        assert shown - first <= 3.0, f"dataloader_next the largest {shown - first:.2f} s after the first step"
        final = pane.wait(lambda t: "job ended (exit 0)" in t, timeout=240)
        summary = json.loads((tmp_path / "summary.json").read_text())
        share = float(next(r for r in _phase_rows(final) if r[0] == "dataloader_next")[2].rstrip("%")) / 100
        want = _shares(summary)["dataloader_next"]
        assert abs(share - want) <= 0.05, (share, want)
        assert "150 steps" in final and "data-loading bound" in final, final
        pane.keys("2")
        pane.wait(lambda t: "ranks (train" in t, timeout=10)
        pane.keys("3")
        pane.wait(lambda t: "one column an export" in t, timeout=10)
        pane.keys("q")
        end = time.monotonic() + 20
        while not pane.status.exists() and time.monotonic() < end:
            time.sleep(0.1)
        assert pane.status.read_text().strip() == "0"
    finally:
        pane.close()


def test_two_ranks_under_torchrun_show_both_and_mark_the_straggler(tmp_path):
    """``top -- torchrun`` (gloo, two ranks, rank 1's loader 80 ms slow a batch): the
    rank view lists ranks 0 and 1 and marks rank 1 the straggler."""
    cmd = [str(BIN / "otel-training"), "top", "--view", "ranks", "--output", str(tmp_path / "job.log"), "--",
           str(BIN / "torchrun"), "--nnodes=1", "--nproc_per_node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(SCRIPTS / "train_ddp_planted.py"), "--steps", "30",
           "--plant", "loader", "--plant-ms", "80"]
    pane = Pane(tmp_path, cmd, _env(tmp_path, OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "s-{rank}.json")))
    try:
        final = pane.wait(lambda t: "job ended (exit 0)" in t, timeout=300)
        rows = {}
        for ln in final.splitlines():
            cells = [c.strip() for c in ln.split("│") if c.strip()]
            if len(cells) >= 8 and cells[0].split()[0].isdigit():
                rows[int(cells[0].split()[0])] = cells
        assert sorted(rows) == [0, 1], final
        assert "straggler" in rows[1][0] and "straggler" not in rows[0][0], final
        assert rows[0][2] == rows[1][2] == "30", final
    finally:
        pane.close()


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_the_viewer_killed_or_frozen_mid_run_changes_nothing_in_the_job(tmp_path, how):
    """Attach mode: a job exporting to the viewer, the viewer killed (SIGKILL) or frozen
    (SIGSTOP) once it shows steps: the job's exit status, step count and summary are
    those of the same job with no viewer ever listening."""
    port = free_port()
    pane = Pane(tmp_path, [str(BIN / "otel-training"), "top", "--listen", f"127.0.0.1:{port}",
                           "--http-listen", f"127.0.0.1:{free_port()}"], _env(tmp_path))
    runs, viewer = {}, []
    try:
        for name, endpoint in (("viewer", port), ("none", free_port())):
            d = tmp_path / name
            d.mkdir()
            env = _env(d, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{endpoint}",
                       OTEL_METRIC_EXPORT_INTERVAL="1000")
            job = subprocess.Popen([str(BIN / "opentelemetry-instrument"), *_loop(120)], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if name == "viewer":
                pane.wait(lambda t: " steps " in t and "train:" in t, timeout=120)
                viewer = subprocess.run(["pgrep", "-f", f"top --listen 127.0.0.1:{port}"], capture_output=True,
                                        text=True).stdout.split()
                assert viewer, "no viewer process"
                for pid in viewer:
                    os.kill(int(pid), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            stdout, stderr = job.communicate(timeout=240)
            runs[name] = (job.returncode, stdout, stderr, json.loads((d / "summary.json").read_text()))
    finally:
        for pid in viewer:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        pane.close()
    (code_v, out_v, err_v, sum_v), (code_n, out_n, _, sum_n) = runs["viewer"], runs["none"]
    assert code_v == code_n == 0, err_v
    assert out_v.splitlines()[-1] == out_n.splitlines()[-1] == "done 120"
    for key in ("steps", "samples"):
        assert sum_v["modes"]["train"][key] == sum_n["modes"]["train"][key], key
    assert sorted(_shares(sum_v)) == sorted(_shares(sum_n))
    assert "Traceback" not in err_v


def test_a_job_that_stops_reporting_is_stale_on_the_screen(tmp_path):
    """Attach mode: a job frozen (SIGSTOP) mid-run shows as ``stale N s`` in the rank
    view within a few export intervals; resumed, it ends as it would have."""
    port = free_port()
    pane = Pane(tmp_path, [str(BIN / "otel-training"), "top", "--view", "ranks", "--listen", f"127.0.0.1:{port}",
                           "--http-listen", f"127.0.0.1:{free_port()}"], _env(tmp_path))
    env = _env(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_METRIC_EXPORT_INTERVAL="1000")
    job = subprocess.Popen([str(BIN / "opentelemetry-instrument"), *_loop(200)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        pane.wait(lambda t: " live" in t, timeout=120)
        job.send_signal(signal.SIGSTOP)
        pane.wait(lambda t: "stale " in t, timeout=30)
        job.send_signal(signal.SIGCONT)
        pane.wait(lambda t: " live" in t or "ended" in t, timeout=30)
        stdout, stderr = job.communicate(timeout=240)
        assert job.returncode == 0 and stdout.splitlines()[-1] == "done 200", stderr
        pane.wait(lambda t: "ended" in t, timeout=30)
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGCONT)
            job.kill()
        pane.close()


# -- memory over an hour -----------------------------------------------------------------------
def test_the_viewers_memory_stays_bounded_over_an_hour_of_steps(tmp_path):
    """An hour at 100 steps a second, replayed as OTLP (3600 exports of a real SDK's
    cumulative histograms, four phases): the viewer's RSS after the hour is under
    120 MiB and within 16 MiB of what it was once its windows filled (600 exports)."""
    import psutil
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    port = free_port()
    viewer = subprocess.Popen([str(BIN / "otel-training"), "top", "--listen", f"127.0.0.1:{port}", "--http-listen",
                               f"127.0.0.1:{free_port()}"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=_env(tmp_path))
    try:
        reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"127.0.0.1:{port}", insecure=True),
                                               export_interval_millis=10**9)
        provider = MeterProvider(resource=Resource.create({"service.name": "replay", "service.instance.id": "r0"}),
                                 metric_readers=[reader])
        meter = provider.get_meter("otel_training")
        step = meter.create_histogram("training.step.duration", unit="s")
        phase = meter.create_histogram("training.phase.duration", unit="s")
        samples = meter.create_counter("training.samples")
        mode = {"training.mode": "train"}
        parts = (("dataloader_next", "step", 0.004), ("train_batch", "step", 0.005), ("forward", "train_batch", 0.002),
                 ("backward", "train_batch", 0.003))
        rss = {}
        proc = psutil.Process(viewer.pid)
        for export in range(1, 3601):
            for i in range(100):
                step.record(0.01 + (i % 7) * 1e-4, mode)
                for name, parent, s in parts:
                    phase.record(s, {**mode, "training.phase": name, "training.phase.parent": parent})
            samples.add(3200, mode)
            assert reader.force_flush(10_000)
            if export in (600, 3600):
                time.sleep(1.0)  # a redraw or two over the full windows
                rss[export] = proc.memory_info().rss
        provider.shutdown()
        assert viewer.poll() is None, viewer.stderr.read().decode() if viewer.stderr else ""
    finally:
        viewer.send_signal(signal.SIGINT)
        try:
            viewer.wait(20)
        except subprocess.TimeoutExpired:
            viewer.kill()
    mib = {k: v / 2**20 for k, v in rss.items()}
    print("viewer RSS MiB after 600 and 3600 exports:", mib)
    assert mib[3600] < 120 and mib[3600] - mib[600] < 16, mib


def test_a_job_that_fails_before_its_first_step_shows_its_output_and_status(tmp_path):
    """Launch mode, no terminal: a job that exits 3 before any step; ``top`` exits 3,
    its last frame shows what the job printed and its status."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('cannot open the dataset: /data/train missing', flush=True)\nsys.exit(3)\n")
    r = subprocess.run([str(BIN / "otel-training"), "top", "--no-wait", "--", str(BIN / "python"), str(script)],
                       env=_env(tmp_path), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert "job ended (exit 3)" in r.stdout and "cannot open the dataset: /data/train missing" in r.stdout, r.stdout
    assert "the job's output:" in r.stderr


def test_sigterm_gives_the_terminal_back(tmp_path):
    """The viewer terminated (SIGTERM) leaves its full-screen mode and cbreak input as it
    exits (status 143): the terminal is as it was."""
    port = free_port()
    pane = Pane(tmp_path, [str(BIN / "otel-training"), "top", "--listen", f"127.0.0.1:{port}",
                           "--http-listen", f"127.0.0.1:{free_port()}"], _env(tmp_path))
    try:
        pane.wait(lambda t: "waiting for a job's first export" in t, timeout=60)
        assert pane._tmux("display", "-p", "-t", pane.name, "#{alternate_on}").strip() == "1"
        pids = subprocess.run(["pgrep", "-f", f"top --listen 127.0.0.1:{port}"], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            os.kill(int(pid), signal.SIGTERM)
        end = time.monotonic() + 20
        while not pane.status.exists() and time.monotonic() < end:
            time.sleep(0.1)
        assert pane.status.read_text().strip() == "143"
        assert pane._tmux("display", "-p", "-t", pane.name, "#{alternate_on}").strip() == "0"
    finally:
        pane.close()


def test_host_and_gpu_gauges_are_on_the_screen(tmp_path, monkeypatch, fake_nvml):  # noqa: F811
    """``otel-training agent`` (hardware only, NVML faked at the pynvml import boundary)
    exporting to the viewer's receiver: the screen names the GPU with its utilization
    and the host's CPU and free memory."""
    import tempfile

    from rich.console import Console

    from otel_training.cli import agent
    from otel_training.cli.top import frame
    from otel_training.live.screen import screen
    from tests.fake_pynvml import FakeGpu

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the per-host lock is ours
    for var in [v for v in os.environ if v.startswith("OTEL_")]:
        monkeypatch.delenv(var)
    run = LiveRun()
    receiver = Receiver(run.add, "127.0.0.1:0", None).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
        assert agent.main(["--interval", "0.05", "--duration", "1"]) == 0
    finally:
        receiver.stop()
    report = live_report(run)
    (gpu,) = report.gpus
    assert gpu.gpu == FakeGpu(0).uuid and 0.0 <= gpu.mean <= 1.0
    console = Console(record=True, width=140)
    console.print(screen(frame(run, "test", None), "overview"))
    text = console.export_text()
    assert f"GPU {gpu.index or gpu.gpu} ({gpu.model})" in text and "busy" in text, text
    assert "CPU " in text and "GiB memory available" in text, text


def test_the_web_variant_serves_the_reports_page_of_the_live_run(tmp_path):
    """``top --web``: while a job runs, the page at the address is the HTML report's
    (its charts and the verdict so far), asking the browser to reload it."""
    import urllib.request

    web = free_port()
    out = tmp_path / "job.log"
    viewer = subprocess.Popen([str(BIN / "otel-training"), "top", "--web", f"127.0.0.1:{web}", "--no-wait",
                               "--output", str(out), "--", *_loop(150)], env=_env(tmp_path),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end, html = time.monotonic() + 120, ""
        while time.monotonic() < end and "data-loading bound" not in html:
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{web}/", timeout=10) as resp:
                    html = resp.read().decode()
            except OSError:
                continue
        assert "data-loading bound" in html, html[-2000:]
        assert '<meta http-equiv="refresh"' in html and "default-src 'none'" in html
        for chart in ("step-time", "throughput", "phase-shares", "breakdown"):
            assert f'data-chart="{chart}"' in html, chart
        assert viewer.wait(240) == 0, viewer.stderr.read() if viewer.stderr else ""
    finally:
        if viewer.poll() is None:
            viewer.kill()


def test_attach_mode_says_what_to_set_when_exports_come_slower_than_each_second(tmp_path):
    """A job exporting every 3 s to ``top --listen``: the header names the interval it
    sees and the variable that makes the view move each second."""
    port = free_port()
    pane = Pane(tmp_path, [str(BIN / "otel-training"), "top", "--listen", f"127.0.0.1:{port}",
                           "--http-listen", f"127.0.0.1:{free_port()}"], _env(tmp_path))
    env = _env(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_METRIC_EXPORT_INTERVAL="3000")
    job = subprocess.Popen([str(BIN / "opentelemetry-instrument"), *_loop(400)], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        text = pane.wait(lambda t: "OTEL_METRIC_EXPORT_INTERVAL=1000" in t, timeout=120)
        assert "exports arrive every 3 s" in text, text
    finally:
        job.kill()
        job.wait(30)
        pane.close()
