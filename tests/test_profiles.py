"""Profiles armed by the run (``OTEL_TRAINING_PROFILE``, docs/profiles.md), on real
processes under ``opentelemetry-instrument``:

* a loop with a planted expensive operator (an SVD) every 50th step: the ``periodic``
  trigger learns the period and records one of those steps itself; its top operator
  is the planted one, in the phase it ran in; the trace file is torch.profiler's
  Chrome trace and ``trace-merge`` takes it; the run-end table, ``report`` (text and
  ``--json``) and the HTML page list it;
* the cap holds (``OTEL_TRAINING_PROFILE_MAX``), and ``off`` records nothing;
* ``otel-training profile PID`` on a running job answers with the file and the top
  operators; the job's step count and exit are unchanged;
* a profiled step's span carries the ``training.profile`` event (over real OTLP).

Which steps are slow is judged by the script's own clock around the planted operator,
never by the constant planted. (The loop suite checks healthy loops profile nothing:
tests/loops/test_loops.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.otlp_receiver import OTLPReceiver, free_port
from tests.scripts.harness import BIN, ROOT, SCRIPTS, Run, otel_env, run

pytestmark = pytest.mark.slow

PLANTED = r'''
import json, os, sys, time
import torch
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)
steps = int(sys.argv[1])
every = int(sys.argv[2])
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(1024, 64), torch.randint(0, 10, (1024,)))
loader = torch.utils.data.DataLoader(data, batch_size=8)
heavy = torch.randn(400, 400) if device == "cpu" else torch.randn(8192, 8192, device=device)


def expensive(loss):
    if device == "cpu":
        return loss + torch.linalg.svd(heavy @ heavy.T)[1].sum() * 0
    for _ in range(20):  # on CUDA: big matrix products, timed by the script's synchronized clock
        loss = loss + (heavy @ heavy).sum() * 0
    torch.cuda.synchronize()
    return loss
planted = {}  # step -> seconds the planted operator took, by this script's clock
step = 0
print("TRAINING_START", flush=True)
while step < steps:
    for x, y in loader:
        if step >= steps:
            break
        x, y = x.to(device), y.to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        if every and step % every == 0 and step > 0:
            t0 = time.perf_counter()
            loss = expensive(loss)
            planted[step] = time.perf_counter() - t0
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.004)
        step += 1
print("TRUTH " + json.dumps({"steps": step, "planted": planted}), flush=True)
'''


def _run(tmp_path: Path, steps: int, every: int, endpoint: str | None = None, device: str = "cpu", **env: str):
    script = tmp_path / "planted.py"
    script.write_text(PLANTED)
    settings = {
        "OTEL_TRAINING_HARDWARE": "false",
        "OTEL_TRAINING_SUMMARY": "true",
        "OTEL_TRAINING_SUMMARY_FILE": str(tmp_path / "summary.json"),
        "OTEL_TRAINING_PROFILE_DIR": str(tmp_path / "profiles"),
    }
    if endpoint is None:
        settings.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    settings.update(env)
    run = Run(
        [str(BIN / "opentelemetry-instrument"), sys.executable, str(script), str(steps), str(every), device],
        otel_env(endpoint, tmp_path, **settings),
    )
    return run


def _finish(run: Run, tmp_path: Path, timeout: float = 300) -> tuple[dict, dict]:
    assert run.wait(timeout) == 0, run.stderr[-3000:]
    truth = json.loads(run.wait_for_line("TRUTH", timeout=0).split(" ", 1)[1])
    summary = json.loads((tmp_path / "summary.json").read_text())
    return truth, summary


def _slow_by_truth(truth: dict) -> set[int]:
    """The planted steps, by the script's own clock: those whose operator took longer
    than the whole of an ordinary step could (the triggers' test is 3x the median)."""
    return {int(k) for k in truth["planted"]}


@pytest.mark.sdk_independent  # (torch.profiler and the summary: no SDK in between)
def test_a_periodic_planted_operator_is_caught_in_its_own_step(tmp_path):
    run = _run(tmp_path, steps=500, every=50)
    truth, summary = _finish(run, tmp_path)
    assert truth["steps"] == 500 and summary["modes"]["train"]["steps"] == 500
    section = summary["profiles"]
    assert "periodic" in section["triggers"]
    periodic = [p for p in section["profiles"] if p["trigger"] == "periodic"]
    assert len(periodic) == 1, section
    p = periodic[0]
    assert p["period"] == 50
    planted = _slow_by_truth(truth)
    caught = [s for s in p["steps"] if s["step"] in planted]
    assert caught, f"the periodic profile recorded {[s['step'] for s in p['steps']]}, planted at {sorted(planted)}"
    assert caught[0]["slow"] is True and p["captured_slow"] is True
    assert caught[0]["covered"] > 0.5
    top = p["top"][0]
    assert "svd" in top["name"], p["top"][:3]
    assert top["phase"] == "train_batch", top  # between forward and backward, inside the batch
    assert p["device"] == "cpu" and p.get("error") is None
    # The file: torch.profiler's Chrome trace, with the planted operator in it.
    path = Path(p["file"])
    assert path.parent == tmp_path / "profiles" and path.name.startswith("profile-")
    doc = json.loads(path.read_text())
    assert any("svd" in str(e.get("name")) for e in doc["traceEvents"])
    # Every capture is at most the cap, and a profile's file exists for each.
    assert len(section["profiles"]) <= 3
    for q in section["profiles"]:
        assert Path(q["file"]).exists()
    # The run-end table lists it.
    assert "profiles: " in run.stderr and "periodic (a slow step that recurs" in run.stderr, run.stderr[-2000:]
    assert "svd" in run.stderr

    # report (text and --json) and the HTML page read it from the summary file.
    report = subprocess.run(
        [str(BIN / "otel-training"), "report", "--summary", str(tmp_path / "summary.json"), "--json"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert report.returncode == 0, report.stderr
    listed = json.loads(report.stdout)["profiles"]
    assert [q["trigger"] for q in listed] == [q["trigger"] for q in section["profiles"]]
    assert listed[0]["rank"] == 0 or listed[0]["rank"] is None
    text = subprocess.run(
        [str(BIN / "otel-training"), "report", "--summary", str(tmp_path / "summary.json")],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert text.returncode == 0 and "periodic" in text.stdout and "svd" in text.stdout, text.stdout
    html = tmp_path / "report.html"
    page = subprocess.run(
        [str(BIN / "otel-training"), "report", "--summary", str(tmp_path / "summary.json"), "--html", str(html)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert page.returncode == 0, page.stderr
    assert "<h3>Profiles</h3>" in html.read_text() and "svd" in html.read_text()

    # trace-merge takes the profile beside the run's own trace events.
    merged = tmp_path / "merged.json"
    out = subprocess.run([str(BIN / "otel-training"), "trace-merge", "-o", str(merged), str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert any("svd" in str(e.get("name")) for e in json.loads(merged.read_text())["traceEvents"])


@pytest.mark.sdk_independent  # (torch.profiler and the summary: no SDK in between)
def test_the_cap_holds_and_off_records_nothing(tmp_path):
    capped = tmp_path / "capped"
    capped.mkdir()
    run = _run(capped, steps=400, every=25, OTEL_TRAINING_PROFILE_INTERVAL="0", OTEL_TRAINING_PROFILE_MAX="2")
    truth, summary = _finish(run, capped)
    assert len(truth["planted"]) == 15  # more chances than the cap
    section = summary["profiles"]
    assert section["requested"] == 2 and len(section["profiles"]) == 2, section
    assert len(list((capped / "profiles").iterdir())) == 2

    off = tmp_path / "off"
    off.mkdir()
    run = _run(off, steps=200, every=25, OTEL_TRAINING_PROFILE="off")
    truth, summary = _finish(run, off)
    assert summary["modes"]["train"]["steps"] == 200
    assert summary.get("profiles") is None
    assert not (off / "profiles").exists()
    assert "profiles:" not in run.stderr


def _listening(pid: int, tmp: Path) -> Path:
    return tmp / f"otel-training-{os.getuid()}" / "profile" / f"{pid}.listening"


def test_on_demand_profile_of_a_running_job(tmp_path):
    with OTLPReceiver() as receiver:
        run = _run(tmp_path, steps=3000, every=0, endpoint=receiver.endpoint, OTEL_TRAINING_PROFILE="demand",
                   OTEL_METRIC_EXPORT_INTERVAL="1000")
        run.wait_for_line("TRAINING_START", timeout=120)
        pid = run.proc.pid
        deadline = time.monotonic() + 60
        while not _listening(pid, tmp_path).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _listening(pid, tmp_path).exists()
        env = dict(os.environ, TMPDIR=str(tmp_path))
        asked = subprocess.run([str(BIN / "otel-training"), "profile", str(pid), "--steps", "3", "--json"],
                               capture_output=True, text=True, timeout=180, env=env)
        assert asked.returncode == 0, asked.stderr
        answer = json.loads(asked.stdout)
        assert answer["trigger"] == "demand" and len(answer["steps"]) == 3, answer
        assert Path(answer["file"]).exists() and answer["top"], answer
        truth, summary = _finish(run, tmp_path)
        # The job is unchanged: every step counted, a clean exit, and it stops listening.
        assert truth["steps"] == 3000 and summary["modes"]["train"]["steps"] == 3000
        assert not _listening(pid, tmp_path).exists()
        listed = summary["profiles"]["profiles"]
        assert [q["trigger"] for q in listed] == ["demand"]
        assert [s["step"] for s in listed[0]["steps"]] == [s["step"] for s in answer["steps"]]
        # The profiled steps' spans, traced whatever the sample, carry the file.
        deadline = time.monotonic() + 30
        events = []
        while time.monotonic() < deadline and len(events) < 3:
            events = [e for _, s in receiver.spans() if s.name == "step" for e in s.events
                      if e.name == "training.profile"]
            time.sleep(0.2)
        assert len(events) == 3, [s.name for _, s in receiver.spans()][:20]
        files = {a.value.string_value for e in events for a in e.attributes if a.key == "training.profile.file"}
        assert files == {answer["file"]}

    # A process that does not listen is told so at once.
    other = subprocess.run([str(BIN / "otel-training"), "profile", str(os.getpid())],
                           capture_output=True, text=True, timeout=60, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert other.returncode == 1 and "is not listening" in other.stderr


@pytest.mark.gpu
def test_a_cuda_profile_ranks_the_planted_kernels(tmp_path):
    """On CUDA the planted step's top entries are its GEMM kernels, with their time on
    the GPU, in the phase that launched them."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run = _run(tmp_path, steps=500, every=50, device="cuda")
    truth, summary = _finish(run, tmp_path)
    periodic = [p for p in summary["profiles"]["profiles"] if p["trigger"] == "periodic"]
    assert len(periodic) == 1, summary["profiles"]
    p = periodic[0]
    assert p["device"] == "cuda"
    assert any(s["step"] in _slow_by_truth(truth) and s["slow"] for s in p["steps"]), p["steps"]
    top = p["top"][0]
    assert "gemm" in top["name"].lower() and top["phase"] == "train_batch", p["top"][:3]


@pytest.mark.sdk_independent  # (torch.profiler and the summary: no SDK in between)
def test_only_the_rank_that_turned_slow_records_a_straggler_profile(tmp_path):
    """Two DDP ranks (gloo); rank 1's backward grows by 40 ms from step 60 on. Rank 0
    waits for it in the gradient all-reduce (its own time is unchanged); rank 1 is
    the straggler, and only it records a profile."""
    env = otel_env(None, tmp_path, OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                   OTEL_TRAINING_HARDWARE="false", GLOO_SOCKET_IFNAME="lo",
                   OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "summary-{rank}.json"),
                   OTEL_TRAINING_PROFILE_DIR=str(tmp_path / "profiles"))
    cmd = [str(BIN / "opentelemetry-instrument"), str(BIN / "torchrun"), "--nnodes=1", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           str(SCRIPTS / "train_ddp_planted.py"), "--steps", "160", "--plant", "backward", "--plant-rank", "1",
           "--plant-ms", "40", "--base-ms", "5", "--plant-from", "60"]
    r = run(cmd, env, timeout=300)
    assert r.proc.returncode == 0, r.stderr[-3000:]
    ranks = {rank: json.loads((tmp_path / f"summary-{rank}.json").read_text()) for rank in (0, 1)}
    assert all(s["modes"]["train"]["steps"] == 160 for s in ranks.values())
    taken = {rank: [p["trigger"] for p in s["profiles"]["profiles"]] for rank, s in ranks.items()}
    assert taken[0] == [], taken
    assert "straggler" in taken[1], taken
    p = next(p for p in ranks[1]["profiles"]["profiles"] if p["trigger"] == "straggler")
    assert all(s["step"] >= 60 for s in p["steps"]) and "rank1" in Path(p["file"]).name, p


RECOMPILING = r'''
import time
import torch
from torch import nn
import torch._dynamo

torch._dynamo.config.automatic_dynamic_shapes = False  # every new batch size recompiles
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
compiled = torch.compile(model, backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
sizes = [8] * 40 + list(range(9, 15)) + [8] * 40
for step, n in enumerate(sizes):
    loss = compiled(torch.randn(n, 32)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.004)
print("STEPS", len(sizes), flush=True)
'''


@pytest.mark.sdk_independent  # (torch.profiler and the summary: no SDK in between)
def test_a_recompilation_burst_records_a_profile(tmp_path):
    """torch.compile recompiling at six batch sizes in a row, after 40 steps of one:
    the ``recompile`` trigger records the steps after the burst."""
    script = tmp_path / "recompiling.py"
    script.write_text(RECOMPILING)
    env = otel_env(None, tmp_path, OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                   OTEL_TRAINING_HARDWARE="false", OTEL_TRAINING_SUMMARY_FILE=str(tmp_path / "summary.json"),
                   OTEL_TRAINING_PROFILE="recompile", OTEL_TRAINING_PROFILE_DIR=str(tmp_path / "profiles"))
    r = run([str(BIN / "opentelemetry-instrument"), sys.executable, str(script)], env, timeout=300)
    assert r.proc.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["modes"]["train"]["steps"] == 86
    assert summary["job"]["compile"]["recompilations"] >= 2, summary["job"].get("compile")
    profiles = summary["profiles"]["profiles"]
    assert [p["trigger"] for p in profiles] == ["recompile"], summary["profiles"]
    assert profiles[0]["steps"] and all(s["step"] >= 40 for s in profiles[0]["steps"])
    # A compiled model's capture says what its ranking shows.
    assert profiles[0]["compiled"] is True and "compiled regions" in profiles[0]["note"]

