"""otel-training report: summary files from real instrumented runs, a real Prometheus
(series loaded with promtool) and error paths against loopback HTTP servers."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from otel_training.cli.report import main

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / ".tools" / "bin" / "prometheus"
PROMTOOL = ROOT / ".tools" / "bin" / "promtool"


def run_report(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ summary files
TRAIN = r"""
import os, time, torch, otel_training
otel_training.instrument(configure_sdk=False)
delay = float(os.environ["SLOW_S"])
class DS(torch.utils.data.Dataset):
    def __len__(self): return 48
    def __getitem__(self, i):
        time.sleep(delay)
        return torch.randn(8), torch.tensor(i % 2)
m = torch.nn.Linear(8, 2); opt = torch.optim.SGD(m.parameters(), 0.1)
for x, y in torch.utils.data.DataLoader(DS(), batch_size=8):
    loss = torch.nn.functional.cross_entropy(m(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    with otel_training.phase("logging"):
        time.sleep(0.004)
"""


@pytest.fixture(scope="module")
def rank_summaries(tmp_path_factory):
    """Two 'ranks' of a real instrumented run; rank 1 loads data 12x slower."""
    d = tmp_path_factory.mktemp("summaries")
    script = d / "train.py"
    script.write_text(TRAIN)
    procs = []
    for rank, slow in ((0, "0.002"), (1, "0.025")):  # rank 1: ~200 ms a step of data, far above load noise
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), SLOW_S=slow,
                   OTEL_TRAINING_SUMMARY_FILE=str(d / "summary-{rank}.json"),
                   OTEL_TRAINING_HARDWARE="false", OTEL_TRAINING_RUN_ID="run-abc",
                   OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
                   OTEL_LOGS_EXPORTER="none", OTEL_SERVICE_NAME="report-test")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=ROOT,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    files = [d / "summary-0.json", d / "summary-1.json"]
    for f in files:
        assert f.exists(), f"instrumented run wrote no summary {f}"
    return files


def test_summary_report_merges_ranks_and_names_the_straggler(rank_summaries, capsys):
    code, out, err = run_report(capsys, "--summary", *map(str, rank_summaries), "--json")
    assert code == 0, err
    rep = json.loads(out)
    s0, s1 = (json.loads(f.read_text()) for f in rank_summaries)
    train = rep["modes"]["train"]
    assert train["steps"] == 12 and train["samples"] == 96
    assert train["step_time_s"] == pytest.approx(s0["modes"]["train"]["step_time_s"]
                                                 + s1["modes"]["train"]["step_time_s"])
    top = [p for p in train["phases"] if p["parent"] == "step"]
    assert sum(p["share"] for p in top) == pytest.approx(1.0, abs=0.02)
    names = {p["name"] for p in train["phases"]}
    assert {"dataloader_next", "train_batch", "logging", "forward", "backward"} <= names
    ranks = rep["ranks"]["train"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[1]["step_mean_s"] > ranks[0]["step_mean_s"]
    # seconds per step, not shares: one-off start-up costs in a 6-step run move shares
    assert ranks[1]["phase_mean_s"]["dataloader_next"] > 2 * ranks[0]["phase_mean_s"]["dataloader_next"]
    assert rep["run"] == "run-abc" and rep["service"] == "report-test"
    kinds = [f["kind"] for f in rep["findings"]]
    # rank 1 is slow because of its data: both findings lead (their order depends on load)
    assert set(kinds[:2]) == {"data_loading", "straggler"}, kinds
    straggler = next(f for f in rep["findings"] if f["kind"] == "straggler")
    assert straggler["rank"] == 1 and "dataloader_next" in straggler["detail"]


def test_summary_report_text(rank_summaries, capsys):
    code, out, _ = run_report(capsys, "--summary", *map(str, rank_summaries))
    assert code == 0
    assert "train: 12 steps, 96 samples" in out
    assert "ranks (train):" in out and "spread: slowest rank 1" in out
    assert "\nverdict: data-loading bound: " in out or "\nverdict: straggler rank 1: " in out
    row = next(line for line in out.splitlines() if line.strip().startswith("dataloader_next"))
    assert "%" in row and "#" in row


def test_summary_report_says_how_a_cpu_run_was_timed(rank_summaries, capsys):
    code, out, _ = run_report(capsys, "--summary", str(rank_summaries[0]))
    assert code == 0
    head = out.splitlines()[0]
    # "timing off" read as "timing disabled": a CPU run is timed by the host clock
    assert head.endswith(", host clock timing (CPU run: no GPU to time)") and "timing off" not in head, head


def test_summary_accepts_a_quoted_glob_and_a_comma_list_as_compare_does(rank_summaries, capsys):
    folder = rank_summaries[0].parent
    code, out, err = run_report(capsys, "--summary", str(folder / "summary-*.json"), "--json")
    assert code == 0, err
    assert json.loads(out)["files"] == [str(f) for f in rank_summaries]
    code, out, err = run_report(capsys, "--summary", ",".join(map(str, rank_summaries)), "--json")
    assert code == 0, err
    assert json.loads(out)["modes"]["train"]["steps"] == 12
    code, _, err = run_report(capsys, "--summary", str(folder / "nothing-*.json"))
    assert code == 2 and "no summary file matches" in err


def test_summary_files_of_different_runs_are_not_added_up_as_ranks(rank_summaries, tmp_path, capsys):
    """Two single-process runs (rank 0 each, their own run ids) are refused, naming each
    file's run; ranks of one job started without torchrun (an id per process) still merge."""
    s0 = json.loads(rank_summaries[0].read_text())
    other = tmp_path / "other-run.json"
    other.write_text(json.dumps(dict(s0, run_id="run-xyz", pid=s0["pid"] + 1, world_size=1)))
    mine = tmp_path / "this-run.json"
    mine.write_text(json.dumps(dict(s0, world_size=1)))
    code, out, err = run_report(capsys, "--summary", str(mine), str(other))
    assert code == 2 and out == ""
    assert "summary files of 2 different runs" in err and len(err.strip().splitlines()) == 1, err
    assert f"{mine} (run run-abc, rank 0)" in err and f"{other} (run run-xyz, rank 0)" in err
    assert "otel-training compare A B" in err
    s1 = json.loads(rank_summaries[1].read_text())
    spawned = tmp_path / "rank-1-own-id.json"
    spawned.write_text(json.dumps(dict(s1, run_id="run-rank-1")))
    code, out, err = run_report(capsys, "--summary", str(rank_summaries[0]), str(spawned), "--json")
    assert code == 0, err
    assert json.loads(out)["modes"]["train"]["steps"] == 12


def test_summary_errors(tmp_path, capsys, rank_summaries):
    missing = tmp_path / "nope.json"
    code, out, err = run_report(capsys, "--summary", str(missing))
    assert code == 2 and out == ""
    assert err.strip() == f"otel-training report: summary file {str(missing)!r} does not exist"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run_report(capsys, "--summary", str(bad))
    assert code == 2 and "is not valid JSON (line 1" in err and len(err.strip().splitlines()) == 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    code, _, err = run_report(capsys, "--summary", str(other))
    assert code == 2 and "is not an otel-training run summary" in err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"schema": "otel-training/summary/v1", "modes": {"train": {"steps": 3}}}))
    code, _, err = run_report(capsys, "--summary", str(broken))
    assert code == 2 and "is malformed" in err and "step_time_s" in err
    code, _, err = run_report(capsys, "--summary", str(rank_summaries[0]), str(rank_summaries[0]))
    assert code == 2 and "same process" in err
    code, _, err = run_report(capsys, "--summary", str(rank_summaries[0]), "--mode", "eval")
    assert code == 2 and "no eval steps" in err


# ------------------------------------------------------------------ real Prometheus
STEP = 15  # seconds between samples
RANKS = {  # rank: (host, steps/s, step seconds/s, phase shares, gpu utilization samples)
    "0": ("node0", 8.0, 0.8, {"dataloader_next": 0.4, "train_batch": 0.5, "untracked": 0.1},
          (0.2, 0.4)),
    "1": ("node1", 5.0, 0.75, {"dataloader_next": 0.6, "train_batch": 0.35, "untracked": 0.05},
          (0.9, 0.9)),
}
CHILDREN = {"forward": 0.2, "backward": 0.25}  # of step time, parent train_batch (both ranks)


def _openmetrics(t0: int, t1: int) -> str:
    """Cumulative series for run r1 (2 ranks) and another run r2, sampled every 15 s;
    each counter is rate * (t - t0 + STEP), as if the process started one step before t0."""
    fams = {}

    def add(name, labels, fn):
        lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        fams.setdefault(name, []).append([f"{name}{{{lab}}} {fn(t, i):.6f} {t}"
                                          for i, t in enumerate(range(t0, t1 + 1, STEP))])

    for rank, (host, steps, secs, shares, gpu) in RANKS.items():
        base = {"job": "svc", "instance": f"i{rank}", "training_run_id": "r1", "host_name": host,
                "training_rank": rank, "training_world_size": "2", "training_mode": "train"}
        age = lambda t, r=1.0: r * (t - t0 + STEP)  # noqa: E731
        add("training_step_duration_seconds_sum", base, lambda t, i, s=secs: age(t, s))
        add("training_step_duration_seconds_count", base, lambda t, i, n=steps: age(t, n))
        add("training_samples_total", base, lambda t, i, n=steps: age(t, 32 * n))
        phases = [(n, "step", s) for n, s in shares.items()] + [
            (n, "train_batch", s) for n, s in CHILDREN.items()]
        for name, parent, share in phases:
            lab = dict(base, training_phase=name, training_phase_parent=parent)
            add("training_phase_duration_seconds_sum", lab, lambda t, i, v=share * secs: age(t, v))
            add("training_phase_duration_seconds_count", lab, lambda t, i, n=steps: age(t, n))
        add("training_gpu_idle_seconds_total", dict(base, training_phase="dataloader_next"),
            lambda t, i, v=0.3 * secs: age(t, v))
        gl = {k: base[k] for k in ("job", "instance", "training_run_id", "host_name")}
        # the wall time by activity: each second of the process, 80% of it in train steps
        for activity, share in (("train", 0.8), ("checkpoint", 0.15), ("other", 0.05)):
            add("training_job_time_seconds_total", dict(gl, training_rank=rank, training_activity=activity),
                lambda t, i, v=share: age(t, v))
        add("hw_gpu_utilization_ratio", dict(gl, hw_id=f"GPU-{host}", gpu_index="0",
                                             hw_model="Test GPU"), lambda t, i, g=gpu: g[i % 2])
    other = {"job": "other", "instance": "j0", "training_run_id": "r2", "host_name": "x",
             "training_mode": "train"}
    add("training_step_duration_seconds_count", other, lambda t, i: i + 1.0)
    add("training_step_duration_seconds_sum", other, lambda t, i: 0.1 * (i + 1))
    agent = {"job": "otel-training-agent", "instance": "a0", "host_name": "x", "hw_id": "GPU-x",
             "gpu_index": "0", "hw_model": "Test GPU"}  # GPUs sampled outside the run
    add("hw_gpu_utilization_ratio", agent, lambda t, i: 0.55)
    out = []
    for name, series in fams.items():
        out.append(f"# TYPE {name} {'gauge' if name.startswith('hw_') else 'unknown'}")
        for lines in series:
            out.extend(lines)
    return "\n".join(out) + "\n# EOF\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    if not (PROMETHEUS.exists() and PROMTOOL.exists()):
        pytest.skip("real Prometheus not installed (run scripts/install-stack.sh)")
    d = tmp_path_factory.mktemp("prom")
    now = int(time.time())
    t0, t1 = now - 1500 - now % STEP, now - 300 - now % STEP
    (d / "data.om").write_text(_openmetrics(t0, t1))
    subprocess.run([str(PROMTOOL), "tsdb", "create-blocks-from", "openmetrics", str(d / "data.om"),
                    str(d / "tsdb")], check=True, capture_output=True, timeout=60)
    (d / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\n")
    port = _free_port()
    proc = subprocess.Popen([str(PROMETHEUS), f"--config.file={d / 'prometheus.yml'}",
                             f"--storage.tsdb.path={d / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(d / "prom.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.25)
        else:
            pytest.fail("Prometheus did not become ready: " + (d / "prom.log").read_text()[-2000:])
        yield {"url": url, "t0": t0, "t1": t1}
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _expected(seconds_of: dict) -> dict:
    """Aggregate expectations given each rank's counted duration (s)."""
    step_time = sum(RANKS[r][2] * seconds_of[r] for r in RANKS)
    dl = sum(RANKS[r][2] * RANKS[r][3]["dataloader_next"] * seconds_of[r] for r in RANKS)
    steps = sum(RANKS[r][1] * seconds_of[r] for r in RANKS)
    return {"step_time": step_time, "dl_share": dl / step_time, "steps": steps}


def test_prometheus_whole_run(prometheus, capsys):
    code, out, err = run_report(capsys, "--prometheus", prometheus["url"], "--run", "r1",
                                "--since", "1h", "--json")
    assert code == 0, err
    rep = json.loads(out)
    span = prometheus["t1"] - prometheus["t0"] + STEP  # whole run, counted from process start
    exp = _expected({"0": span, "1": span})
    train = rep["modes"]["train"]
    assert train["step_time_s"] == pytest.approx(exp["step_time"], rel=1e-6)
    assert train["steps"] == round(exp["steps"])
    share = {p["name"]: p["share"] for p in train["phases"] if p["parent"] == "step"}
    assert share["dataloader_next"] == pytest.approx(exp["dl_share"], rel=1e-6)
    assert sum(share.values()) == pytest.approx(1.0)
    fwd = next(p for p in train["phases"] if p["name"] == "forward")
    assert fwd["parent"] == "train_batch" and fwd["share"] == pytest.approx(0.2)
    assert train["gpu_idle_share"] == pytest.approx(0.3)
    assert train["throughput_sps"] == pytest.approx(32 * 8 / 0.8 + 32 * 5 / 0.75, rel=1e-6)
    ranks = rep["ranks"]["train"]
    assert [(r["rank"], r["host"]) for r in ranks] == [(0, "node0"), (1, "node1")]
    assert ranks[0]["step_mean_s"] == pytest.approx(0.1) and ranks[1]["step_mean_s"] == pytest.approx(0.15)
    gpus = {g["host"]: g for g in rep["gpus"]}
    assert gpus["node0"]["mean"] == pytest.approx(0.3, abs=0.01) and gpus["node0"]["min"] == pytest.approx(0.2)
    assert gpus["node1"]["mean"] == pytest.approx(0.9)
    assert rep["gpu_utilization"]["min"] == pytest.approx(0.2)
    kinds = [f["kind"] for f in rep["findings"]]
    assert kinds[0] == "data_loading"
    straggler = next(f for f in rep["findings"] if f["kind"] == "straggler")
    assert straggler["rank"] == 1 and "node1" in straggler["detail"] and "1.50x" in straggler["detail"]


def test_prometheus_window_counts_only_increase(prometheus, capsys):
    start = prometheus["t0"] + 20 * STEP
    code, out, err = run_report(capsys, "--prometheus", prometheus["url"], "--run", "job=svc",
                                "--start", str(start), "--end", str(prometheus["t1"]), "--json")
    assert code == 0, err
    rep = json.loads(out)
    span = prometheus["t1"] - start
    exp = _expected({"0": span, "1": span})
    assert rep["modes"]["train"]["step_time_s"] == pytest.approx(exp["step_time"], rel=1e-6)
    assert rep["selector"] == '{job="svc"}'


def test_prometheus_text_and_run_by_job(prometheus, capsys):
    code, out, err = run_report(capsys, "--prometheus", prometheus["url"] + "/", "--run", "svc")
    assert code == 0, err
    assert 'job="svc"' in out.splitlines()[0]
    assert "GPU utilization (hw_gpu_utilization_ratio):" in out
    n = (prometheus["t1"] - prometheus["t0"]) // STEP + 1  # samples: 0.2, 0.4, 0.2, ...
    node0 = ((n + 1) // 2 * 0.2 + n // 2 * 0.4) / n
    assert f"all 2 GPUs: mean {100 * (node0 + 0.9) / 2:.1f}%, lowest 20.0%" in out
    assert "spread: slowest rank 1 (node1) 1.50x the fastest, 1.50x the others' median" in out
    assert "GPU idle: 30.0% of step time" in out


def test_prometheus_run_selection_errors(prometheus, capsys):
    url = prometheus["url"]
    code, out, err = run_report(capsys, "--prometheus", url)
    assert code == 2 and out == ""
    assert "several runs in range, pick one with --run" in err
    assert "training_run_id=r1" in err and "training_run_id=r2" in err
    code, _, err = run_report(capsys, "--prometheus", url, "--run", "nope")
    assert code == 2 and "no otel-training steps for run 'nope'" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run_report(capsys, "--prometheus", url, "--run", "r1", "--start",
                              str(time.time() - 60))
    assert code == 2 and "no otel-training steps for run 'r1'" in err
    code, out, err = run_report(capsys, "--prometheus", url, "--run", "r2", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["modes"]["train"]["steps"] > 0
    # no GPU series carry the run's labels: those of its hosts (the agent's) are used
    assert [(g["host"], g["gpu"], round(g["mean"], 2)) for g in rep["gpus"]] == [("x", "GPU-x", 0.55)]


# ------------------------------------------------------------------ error paths
class _Handler(http.server.BaseHTTPRequestHandler):
    status, ctype, body = 200, "application/json", b"{}"

    def _answer(self):
        self.send_response(self.status)
        self.send_header("Content-Type", self.ctype)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_POST = _answer

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_server():
    servers = []

    def start(status, body, ctype="application/json"):
        handler = type("H", (_Handler,), {"status": status, "body": body, "ctype": ctype})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_unreachable_prometheus(capsys):
    port = _free_port()
    code, out, err = run_report(capsys, "--prometheus", f"http://127.0.0.1:{port}", "--run", "x",
                                "--timeout", "2")
    assert code == 2 and out == ""
    assert err.startswith(f"otel-training report: cannot reach Prometheus at http://127.0.0.1:{port}: ")
    assert len(err.strip().splitlines()) == 1


def test_not_a_prometheus(fake_server, capsys):
    url = fake_server(404, b"<html>not found</html>", "text/html")
    code, _, err = run_report(capsys, "--prometheus", url, "--run", "x")
    assert code == 2 and "answered HTTP 404 (is this a Prometheus server?)" in err
    url = fake_server(200, b"hello")
    code, _, err = run_report(capsys, "--prometheus", url, "--run", "x")
    assert code == 2 and "did not answer like the Prometheus HTTP API" in err


def test_prometheus_api_error_is_reported(fake_server, capsys):
    body = json.dumps({"status": "error", "errorType": "bad_data", "error": "parse error"}).encode()
    code, _, err = run_report(capsys, "--prometheus", fake_server(400, body), "--run", "x")
    assert code == 2 and "rejected the query: bad_data: parse error" in err


def test_bad_arguments(capsys):
    code, _, err = run_report(capsys, "--prometheus", "localhost:9090", "--run", "x")
    assert code == 2 and "is not an http(s) URL" in err
    code, _, err = run_report(capsys, "--prometheus", "http://127.0.0.1:1", "--since", "soon")
    assert code == 2 and "'soon' is not a duration" in err
    code, _, err = run_report(capsys, "--prometheus", "http://127.0.0.1:1", "--run", "a b=c")
    assert code == 2 and "is not a label name" in err


def test_prometheus_goodput_by_rank(prometheus, capsys):
    """The wall time by activity over the range, per process, and the job's goodput."""
    code, out, err = run_report(capsys, "--prometheus", prometheus["url"], "--run", "r1", "--since", "1h", "--json")
    assert code == 0, err
    jobs = json.loads(out)["job"]
    assert [j["rank"] for j in jobs] == [0, 1]
    for j in jobs:
        assert j["goodput"] == pytest.approx(0.8, rel=1e-3)
        assert j["activities"]["checkpoint"] == pytest.approx(0.15 * j["wall_s"], rel=1e-3)
    code, out, err = run_report(capsys, "--prometheus", prometheus["url"], "--run", "r1", "--since", "1h")
    assert code == 0, err
    assert "goodput (rank 0): 80.0% of the" in out and "job goodput: 80.0% (mean over 2 ranks)" in out, out
