"""The offline HTML report: ``report --html`` from summary files (one rank,
two ranks merged) and from a real Prometheus, two runs side by side (``compare
--html``, ``report --html --compare``) and ``demo --html``, each loaded in a real
headless Chromium from ``file://`` with the network off: the charts render (chart
elements present, canvases not blank), no script error, no request leaves the page,
and a screenshot is taken. Without Chromium the browser test skips with the reason;
under ``CI=true`` it fails instead."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from otel_training.cli import main
from tests.browser import find_chromium, load
from tests.otlp_receiver import free_port

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / ".tools" / "bin"
BASE = {"step-time", "throughput", "phase-shares", "breakdown"}

TRAIN = r"""
import os, time, torch, otel_training
otel_training.instrument(configure_sdk=False)
delay = float(os.environ["SLOW_S"])
class DS(torch.utils.data.Dataset):
    def __len__(self): return 96
    def __getitem__(self, i):
        time.sleep(delay)
        return torch.randn(8), torch.tensor(i % 2)
m = torch.nn.Linear(8, 2); opt = torch.optim.SGD(m.parameters(), 0.1)
for epoch in range(2):
    for x, y in torch.utils.data.DataLoader(DS(), batch_size=4):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        with otel_training.phase("logging"):
            time.sleep(0.002)
    with torch.no_grad():
        for x, _ in torch.utils.data.DataLoader(DS(), batch_size=16):
            m(x)
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRAINING_HARDWARE="false", OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none",
               OTEL_LOGS_EXPORTER="none", OTEL_SERVICE_NAME="html-test")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    """Real instrumented runs, concurrently: a slow and a fast one, and two 'ranks'."""
    d = tmp_path_factory.mktemp("runs")
    (d / "train.py").write_text(TRAIN)
    jobs = {"slow": dict(SLOW_S="0.003"), "fast": dict(SLOW_S="0"),
            "rank0": dict(SLOW_S="0.001", RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", OTEL_TRAINING_RUN_ID="ranks"),
            # (8x rank 0's wait: four concurrent runs on two busy cores can make a step take
            # tens of ms of CPU, which a smaller gap drowned in)
            "rank1": dict(SLOW_S="0.008", RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", OTEL_TRAINING_RUN_ID="ranks")}
    procs = {name: subprocess.Popen([sys.executable, str(d / "train.py")], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                    env=_env(OTEL_TRAINING_SUMMARY_FILE=str(d / f"{name}.json"), **extra))
             for name, extra in jobs.items()}
    for name, p in procs.items():
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
    return {name: d / f"{name}.json" for name in jobs}


# ------------------------------------------------------------------------------ Prometheus
STEP = 15
BOUNDS = (0.05, 0.1, 0.25, float("inf"))
# run: rank -> (host, steps/s, step s/s, phase shares, cumulative share of steps per bound, GPU util, GPU memory)
RUNS = {
    "r1": {"0": ("node0", 8.0, 0.8, {"dataloader_next": 0.4, "train_batch": 0.5, "untracked": 0.1},
                 (0.0, 0.5, 1.0, 1.0), 0.35, 6 * 2**30),
           "1": ("node1", 5.0, 0.75, {"dataloader_next": 0.6, "train_batch": 0.35, "untracked": 0.05},
                 (0.0, 0.2, 1.0, 1.0), 0.9, 7 * 2**30)},
    "r2": {"0": ("node0", 4.0, 0.8, {"dataloader_next": 0.7, "train_batch": 0.25, "untracked": 0.05},
                 (0.0, 0.0, 1.0, 1.0), 0.2, 6 * 2**30)},
}


def _openmetrics(t0: int, t1: int) -> str:
    fams: dict = {}

    def add(name, labels, fn):
        lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        fams.setdefault(name, []).append([f"{name}{{{lab}}} {fn(t):.6f} {t}" for t in range(t0, t1 + 1, STEP)])

    for run, ranks in RUNS.items():
        for rank, (host, steps, secs, shares, cdf, util, mem) in ranks.items():
            base = {"job": "svc-" + run, "instance": f"{run}-{rank}", "training_run_id": run, "host_name": host,
                    "training_rank": rank, "training_world_size": str(len(ranks)), "training_mode": "train"}
            age = lambda t, r: r * (t - t0 + STEP)  # noqa: E731
            add("training_step_duration_seconds_sum", base, lambda t, s=secs: age(t, s))
            add("training_step_duration_seconds_count", base, lambda t, n=steps: age(t, n))
            for bound, share in zip(BOUNDS, cdf):
                le = "+Inf" if bound == float("inf") else repr(bound)
                add("training_step_duration_seconds_bucket", dict(base, le=le), lambda t, n=steps * share: age(t, n))
            add("training_samples_total", base, lambda t, n=steps: age(t, 32 * n))
            for name, share in shares.items():
                lab = dict(base, training_phase=name, training_phase_parent="step")
                add("training_phase_duration_seconds_sum", lab, lambda t, v=share * secs: age(t, v))
                add("training_phase_duration_seconds_count", lab, lambda t, n=steps: age(t, n))
            add("training_gpu_idle_seconds_total", dict(base, training_phase="dataloader_next"),
                lambda t, v=0.3 * secs: age(t, v))
            gpu = {k: base[k] for k in ("job", "instance", "training_run_id", "host_name")}
            gpu.update(hw_id=f"GPU-{host}", gpu_index="0", hw_model="Test GPU")
            add("hw_gpu_utilization_ratio", gpu, lambda t, u=util: u)
            add("hw_gpu_memory_usage_bytes", gpu, lambda t, m=mem: m)
    out = []
    for name, series in fams.items():
        kind = "gauge" if name.startswith("hw_") else "unknown"
        out.append(f"# TYPE {name} {kind}")
        for lines in series:
            out.extend(lines)
    return "\n".join(out) + "\n# EOF\n"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    prom, promtool = TOOLS / "prometheus", TOOLS / "promtool"
    if not (prom.exists() and promtool.exists()):
        if os.environ.get("CI") == "true":
            pytest.fail("real Prometheus not installed (scripts/install-stack.sh)")
        pytest.skip("real Prometheus not installed (run scripts/install-stack.sh)")
    d = tmp_path_factory.mktemp("prom")
    now = int(time.time())
    t0, t1 = now - 1500 - now % STEP, now - 300 - now % STEP
    (d / "data.om").write_text(_openmetrics(t0, t1))
    subprocess.run([str(promtool), "tsdb", "create-blocks-from", "openmetrics", str(d / "data.om"), str(d / "tsdb")],
                   check=True, capture_output=True, timeout=120)
    (d / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\n")
    port = free_port()
    proc = subprocess.Popen([str(prom), f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'tsdb'}",
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


# ------------------------------------------------------------------------------ reports
@pytest.fixture(scope="module")
def reports(summaries, tmp_path_factory):
    """name -> (HTML file, the chart ids it must draw)."""
    d = tmp_path_factory.mktemp("html")
    out = {}
    s = {k: str(v) for k, v in summaries.items()}

    def cli(*argv):
        assert main(list(argv)) == 0, argv

    cli("report", "--summary", s["slow"], "--html", str(d / "single.html"))
    out["single"] = (d / "single.html", BASE)
    cli("report", "--summary", s["rank0"], s["rank1"], "--html", str(d / "ranks.html"))
    out["ranks"] = (d / "ranks.html", BASE | {"rank-bars", "rank-time"})
    cli("compare", s["slow"], s["fast"], "--html", str(d / "compare.html"))
    both = {"cmp-phases", "cmp-step-time"} | {p + c for p in ("a-", "b-") for c in BASE}
    out["compare"] = (d / "compare.html", both)
    cli("report", "--summary", s["slow"], "--compare", s["fast"], "--html", str(d / "side.html"))
    out["side"] = (d / "side.html", both)
    demo = subprocess.run([sys.executable, "-m", "otel_training.cli", "demo", "--epochs", "1", "--samples", "96",
                           "--batch-size", "16", "--sample-delay-ms", "1", "--html", str(d / "demo.html")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert demo.returncode == 0, demo.stderr
    assert "verdict:" in demo.stderr and f"wrote {d / 'demo.html'}" in demo.stderr
    out["demo"] = (d / "demo.html", BASE)
    return out


@pytest.fixture(scope="module")
def prometheus_reports(prometheus, tmp_path_factory):
    d = tmp_path_factory.mktemp("prom-html")
    url = prometheus["url"]
    assert main(["report", "--prometheus", url, "--run", "r1", "--html", str(d / "prom.html")]) == 0
    assert main(["report", "--prometheus", url, "--run", "r1", "--compare", "r2", "--html", str(d / "prom2.html")]) == 0
    gpu = {"gpu-utilization", "gpu-memory", "gpu-idle"}
    return {"prometheus": (d / "prom.html", BASE | {"rank-bars", "rank-time"} | gpu),
            "prometheus-side": (d / "prom2.html", {"cmp-phases", "cmp-step-time"} | {"a-" + c for c in BASE | gpu})}


def _charts(path: Path) -> dict:
    html = path.read_text()
    data = re.search(r'<script type="application/json" id="otel-training-data">(.*?)</script>', html, re.S)
    return json.loads(data.group(1))["charts"]


def test_html_is_one_self_contained_file(reports):
    for name, (path, ids) in reports.items():
        html = path.read_text()
        assert "default-src 'none'" in html, name  # the page may load nothing
        assert not re.search(r"<(script|img|iframe)[^>]*\ssrc=|<link\b", html, re.I), name
        assert "uPlot" in html and len(html) < 400_000, (name, len(html))
        charts = _charts(path)
        assert ids <= set(charts), (name, ids - set(charts))
        assert set(re.findall(r'data-chart="([^"]+)"', html)) == set(charts)
        assert "Findings and advice" in html and "verdict:" in html


def test_chart_numbers_come_from_the_summaries(reports, summaries):
    s = json.loads(summaries["slow"].read_text())
    charts = _charts(reports["single"][0])
    shares = charts["phase-shares"]
    for i in range(len(shares["x"])):  # stacked shares of step time add up to 100%
        assert abs(sum(ser["values"][i] for ser in shares["series"]) - 100) < 0.1
    labels = [ser["label"] for ser in charts["step-time"]["series"]]
    assert labels == ["train p50", "train p90", "eval p50", "eval p90"]
    bars = charts["breakdown"]
    top = [p for p in s["modes"]["train"]["phases"] if p["parent"] == "step"]
    assert bars["categories"] == [p["name"] for p in top]  # largest first, as in the summary
    assert bars["series"][0]["values"][0] == pytest.approx(1e3 * top[0]["mean_s"], rel=1e-3)
    # two ranks merged: per-rank bars and lines, rank 1 (slower data) above rank 0
    ranks = _charts(reports["ranks"][0])
    assert ranks["rank-bars"]["categories"][0].startswith("rank 0") and len(ranks["rank-bars"]["categories"]) == 2
    r0, r1 = ranks["rank-time"]["series"]
    assert sum(v for v in r1["values"] if v) / len([v for v in r1["values"] if v]) > \
        sum(v for v in r0["values"] if v) / len([v for v in r0["values"] if v])


def test_prometheus_chart_numbers(prometheus_reports):
    charts = _charts(prometheus_reports["prometheus"][0])
    p50 = [v for ser in charts["step-time"]["series"] if ser["label"] == "train p50" for v in ser["values"] if v]
    p90 = [v for ser in charts["step-time"]["series"] if ser["label"] == "train p90" for v in ser["values"] if v]
    # rank 0: half the steps <= 0.1 s, all <= 0.25 s; rank 1: 20% <= 0.1 s -> histogram quantiles,
    # weighted by steps (8 and 5 per second)
    r0_50, r1_50 = 100.0, 100 + 150 * (0.5 - 0.2) / 0.8
    r0_90, r1_90 = 100 + 150 * 0.4 / 0.5, 100 + 150 * (0.9 - 0.2) / 0.8
    assert all(v == pytest.approx((8 * r0_50 + 5 * r1_50) / 13, rel=1e-3) for v in p50[1:]), p50
    assert all(v == pytest.approx((8 * r0_90 + 5 * r1_90) / 13, rel=1e-3) for v in p90[1:]), p90
    util = {ser["label"]: ser["values"] for ser in charts["gpu-utilization"]["series"]}
    assert {k: max(v for v in vals if v is not None) for k, vals in util.items()} == {
        "node0 gpu 0": pytest.approx(35.0), "node1 gpu 0": pytest.approx(90.0)}
    mem = {ser["label"]: max(v for v in ser["values"] if v is not None) for ser in charts["gpu-memory"]["series"]}
    assert mem == {"node0 gpu 0": pytest.approx(6.0), "node1 gpu 0": pytest.approx(7.0)}
    idle = [v for v in charts["gpu-idle"]["series"][0]["values"] if v is not None]
    assert all(v == pytest.approx(30.0, rel=1e-3) for v in idle[1:])
    tput = [v for v in charts["throughput"]["series"][0]["values"] if v]
    # each rank's samples over its own step time: 8 steps of 32 in 0.8 s, 5 in 0.75 s
    assert all(v == pytest.approx(32 * 8 / 0.8 + 32 * 5 / 0.75, rel=1e-3) for v in tput[1:-1])


def test_compare_two_prometheus_runs(prometheus, capsys):
    code = main(["compare", "r1", "r2", "--prometheus", prometheus["url"], "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    c = json.loads(out)
    assert c["result"] == "regression" and c["changed_phase"] == "dataloader_next"
    assert c["step"]["a"] == pytest.approx((0.8 + 0.75) / (8 + 5), rel=1e-3)  # both ranks' steps
    assert c["step"]["b"] == pytest.approx(0.2, rel=1e-3)  # 0.8 s of steps per s at 4 steps/s
    assert c["step"]["noise"] == pytest.approx(0.0, abs=1e-6)  # synthetic series: no noise, the floor judges
    assert c["verdict"]["a"]["kind"] == "data_loading" and c["verdict"]["b"]["kind"] == "data_loading"


# ------------------------------------------------------------------------------ a real browser
def _browser():
    exe = find_chromium()
    if exe is None:
        reason = "no Chromium on PATH (bash scripts/install-chromium.sh installs Debian's chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return exe


@pytest.mark.slow
@pytest.mark.parametrize("name", ["single", "ranks", "compare", "side", "demo", "prometheus", "prometheus-side"])
def test_report_renders_offline_in_chromium(name, request, tmp_path):
    exe = _browser()
    fixture = "prometheus_reports" if name.startswith("prometheus") else "reports"
    path, ids = request.getfixturevalue(fixture)[name]
    shot = tmp_path / f"{name}.png"
    page = load(path, shot, executable=exe)
    assert page["errors"] == [], page["errors"]
    assert page["requests"] == [page["url"]], page["requests"]  # the file itself, nothing else
    assert page["state"] == {"charts": len(page["charts"]), "rendered": len(page["charts"]), "errors": []}
    drawn = {c["id"]: c for c in page["charts"]}
    assert ids <= set(drawn), ids - set(drawn)
    for c in page["charts"]:
        assert c["rendered"] and c["canvas"] and c["title"], c
        area = c["width"] * c["height"]
        assert area > 300 * 200, c
        assert c["inked"] > 0.01 * area and c["colors"] >= 2, c  # lines, areas or bars, not a blank canvas
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
