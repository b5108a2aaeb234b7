"""The product's path end to end, on the real stack: ``otel-training stack up`` runs the
Collector built from the Builder manifest on collector-config/config.yaml, Prometheus
with its own OTLP receiver, Alertmanager, and Jaeger where Tempo stands; an unmodified
loop (examples/train_basic.py, two torchrun ranks over gloo) under
``opentelemetry-instrument`` exports to the Collector with nothing but
``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at it, the fake NVML in place of a GPU driver.

Two jobs train at once: ``stack-e2e`` on busy GPUs, ``stack-e2e-idle`` on GPUs of its own
that sit at 3%. The changes the test makes to the shipped files: tests/stack/realstack.py.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from otel_training.cli.stack_check import contract_names
from tests.stack import grafana, real_run
from tests.stack import promql as q
from tests.stack.realstack import Stack, cli, for_test, wait_for
from tests.stack.test_alertmanager import Webhook

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HEALTHY, IDLE = "stack-e2e", "stack-e2e-idle"
HEALTHY_STEPS = 1500
FIRE_AT_ONCE = ("TrainingGPUUtilizationLow", "TelemetryCollectorDown")

# Metrics of docs/telemetry.md that a CPU run of train_basic.py cannot produce, and why.
NOT_FROM_A_CPU_RUN = {
    "training_gpu_idle_seconds_total": "GPU idle time needs CUDA device timing",
    "training_telemetry_errors_total": "counted only when a hook or thread of ours fails",
    "training_tokens_total": "the example trains on float features, not token ids",
    "training_memory_allocated_bytes": "CUDA allocator statistics need CUDA",
    "training_memory_reserved_bytes": "CUDA allocator statistics need CUDA",
    "training_memory_peak_allocated_bytes": "CUDA allocator statistics need CUDA",
    "training_memory_peak_reserved_bytes": "CUDA allocator statistics need CUDA",
    "training_memory_alloc_retries_total": "CUDA allocator statistics need CUDA",
    "training_memory_ooms_total": "CUDA allocator statistics need CUDA",
    "training_skipped_updates_total": "counted only when a GradScaler skips an update (CUDA AMP)",
    "training_data_throughput_per_second": "exported by `otel-training bench-data`, not by a training run",
    "training_data_stage_duration_seconds": "exported by `otel-training bench-data`, not by a training run",
}


def _contract() -> dict:
    """Prometheus name -> (OTel unit, attribute label names) from docs/telemetry.md's tables."""
    out = {}
    header = None
    for line in (ROOT / "docs" / "telemetry.md").read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set(cells[0]) <= set("-: ") or "OTel name" not in header[0]:
            continue
        col = {name.split(" (")[0]: i for i, name in enumerate(header)}
        prom = re.findall(r"`([a-z_0-9]+)`", cells[col["Prometheus 3 name"]])
        if not prom:
            continue
        attrs = {a.replace(".", "_") for a in re.findall(r"`([a-z_.]+)`", cells[col["attributes"]])
                 if "." in a and not a.endswith("_")}
        if "GPU" in cells[col["attributes"]]:
            attrs |= {"hw_id", "hw_type", "hw_model", "gpu_index"}
        out[prom[0]] = (cells[col["unit"]].strip("`"), attrs)
    return out


CONTRACT = _contract()


def _training_env(stack: Stack, service: str, tmp: str, **extra) -> dict:
    """What a user sets (the endpoint, a service name) and what the test needs: the fake
    NVML, 1 s exports and hardware samples, a private per-host lock, gloo on loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({
        "OTEL_EXPORTER_OTLP_ENDPOINT": stack.otlp_grpc,
        "OTEL_SERVICE_NAME": service,
        "OTEL_METRIC_EXPORT_INTERVAL": "1000",
        "OTEL_TRAINING_HARDWARE_INTERVAL": "0.5",
        "OTEL_TRAINING_TRACE_EVERY_N": "5",
        "OTEL_TRAINING_PEAK_FLOPS": "1e11",
        "PYTHONPATH": os.pathsep.join([str(real_run.FAKE_GPU_SITE), str(ROOT)]),
        "TMPDIR": tmp,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        **extra,
    })
    return env


def _train(stack: Stack, steps: int = 300) -> dict:
    """Both jobs at once; returns each one's output. The healthy job has no planted data
    delay (its data wait is a few % of the step); the idle one keeps the example's defaults."""
    bin_dir = Path(sys.executable).parent
    base = [str(bin_dir / "opentelemetry-instrument"), str(bin_dir / "torchrun"), "--standalone",
            "--nproc_per_node=2", str(ROOT / "examples" / "train_basic.py")]
    # The healthy job exports for 10 s at least, however fast the machine (2 ms of
    # "logging" a step: untracked time, which no alert watches), so every rate over it
    # has points to work with.
    cmds = {HEALTHY: base + ["--steps", str(HEALTHY_STEPS), "--batch-delay-ms", "0", "--log-delay-ms", "2"],
            IDLE: base + ["--steps", str(steps)]}
    outputs, procs = {}, {}
    with tempfile.TemporaryDirectory() as busy_tmp, tempfile.TemporaryDirectory() as idle_tmp:
        envs = {HEALTHY: _training_env(stack, HEALTHY, busy_tmp),
                IDLE: _training_env(stack, IDLE, idle_tmp, FAKE_NVML_BUSY_PERCENT="3",
                                    FAKE_NVML_UUID_PREFIX="GPU-11111111-0000-0000-0000-0000000000")}
        try:
            for name, env in envs.items():
                procs[name] = subprocess.Popen(cmds[name], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True)
            for name, proc in procs.items():
                out, _ = proc.communicate(timeout=600)
                assert proc.returncode == 0 and "Traceback" not in out, f"{name} failed:\n{out[-4000:]}"
                outputs[name] = out
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
    return outputs


@pytest.fixture(scope="module")
def stack(stack_bin, tmp_path_factory):
    webhook = Webhook()
    directory = tmp_path_factory.mktemp("real-stack") / "s"
    s = Stack(directory, stack_bin)
    assert cli("stack", "init", str(directory)).returncode == 0
    for_test(directory, webhook.url, FIRE_AT_ONCE)
    s.webhook = webhook
    try:
        s.up()
        s.started = time.time()
        s.outputs = _train(s)
        s.trained = time.time()
        # the last exports (every rank's final point), then the rules evaluated over them
        wait_for(lambda: [float(r["value"][1]) for r in s.prometheus.query(
            f'max by (training_rank) (training_steps_total{{job="{HEALTHY}"}})')] == [HEALTHY_STEPS] * 2, 60)
        time.sleep(3)
        s.settled = time.time()  # every point stored, and recorded by the 1 s rule evaluations
        yield s
    finally:
        s.down()
        webhook.close()


def _values(stack: Stack) -> dict:
    """One value per dashboard variable: the healthy job, its run, rank 0, GPU 0."""
    (series, *_) = stack.prometheus.query(f'training_steps_total{{job="{HEALTHY}", training_rank="0"}}')
    labels = series["metric"]
    gpu = stack.prometheus.query(f'hw_gpu_utilization_ratio{{job="{HEALTHY}"}}')
    return {"job": HEALTHY, "training_run_id": labels["training_run_id"], "host_name": labels["host_name"],
            "training_rank": "0", "gpu_index": sorted(r["metric"]["gpu_index"] for r in gpu)[0]}


def _finite(result: list) -> bool:
    return any(math.isfinite(float(v)) for s in result for _, v in (s.get("values") or [s["value"]]))


# --- metrics under the contract's names ---------------------------------------------------------

def test_every_metric_a_cpu_run_can_produce_arrives_under_its_contract_name(stack):
    names = set(stack.prometheus.api("/api/v1/label/__name__/values", {"match[]": f'{{job="{HEALTHY}"}}'},
                                     "GET"))
    expected = {n for n in contract_names() if not n.endswith(("_bucket", "_sum", "_count"))}
    histograms = {n for n in expected if f"{n}_bucket" in contract_names()}
    present = {n for n in expected if n in names or (n in histograms and f"{n}_bucket" in names)}
    missing = expected - present - set(NOT_FROM_A_CPU_RUN)
    assert not missing, f"not in Prometheus: {sorted(missing)}"
    # what we call impossible on a CPU must really be absent, or the list is stale
    arrived_anyway = {n for n in NOT_FROM_A_CPU_RUN if n in present}
    assert not arrived_anyway, " ".join(sorted(arrived_anyway))
    unknown = {n for n in names if n.startswith(("training_", "hw_", "system_", "process_gpu_"))
               and n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") not in expected}
    assert not unknown, f"in Prometheus but not in the contract: {sorted(unknown)}"


@pytest.mark.parametrize("name", sorted(n for n in CONTRACT if n not in NOT_FROM_A_CPU_RUN))
def test_each_metric_has_its_contract_labels_and_unit(stack, name):
    _, attrs = CONTRACT[name]
    selector = f"{name}_bucket" if f"{name}_bucket" in contract_names() else name
    result = stack.prometheus.query(f'{selector}{{job="{HEALTHY}"}}')
    assert result, f"{selector}: no series"
    labels = set().union(*(r["metric"] for r in result))
    need = {"job", "instance", "training_run_id", "host_name"} | attrs
    if name.startswith("training_") and not name.startswith("training_job_") and name != "training_goodput_ratio":
        need |= {"training_rank", "training_local_rank", "training_world_size"}
    assert need <= labels, f"{name}: missing labels {sorted(need - labels)}"
    # the unit is in the name (UnderscoreEscapingWithSuffixes: seconds, bytes, ratio, _total):
    # the series exists under the contract's name, so Prometheus translated the unit as documented


def test_hardware_gauges_carry_the_agent_and_gpu_identity(stack):
    for r in stack.prometheus.query(f'hw_gpu_utilization_ratio{{job="{HEALTHY}"}}'):
        m = r["metric"]
        assert m["host_name"] and m["hw_type"] == "gpu" and m["hw_id"].startswith("GPU-0000")
        assert m["hw_model"] == "NVIDIA H100 80GB HBM3" and m["gpu_index"] in ("0", "1")
    (cpu,) = stack.prometheus.query(f'system_cpu_utilization_ratio{{job="{HEALTHY}"}}')
    assert cpu["metric"]["host_name"]


def test_both_ranks_report_their_steps(stack):
    result = stack.prometheus.query(f'max by (training_rank) (training_steps_total{{job="{HEALTHY}"}})')
    assert {r["metric"]["training_rank"]: float(r["value"][1]) for r in result} == {
        "0": float(HEALTHY_STEPS), "1": float(HEALTHY_STEPS)}


# --- rules, panels, alerts ----------------------------------------------------------------------

RULES = list(q.rules())
RECORDS = [r for r in RULES if "record" in r]
TARGETS = [(name, panel, target) for name, dash in q.dashboards().items() for panel, target in q.panel_queries(dash)]


# What shares and rates are taken over: present in every run.
DENOMINATORS = {"training_steps_total", "training_step_duration_seconds_sum"}


def _cpu_impossible(expr: str, impossible: set = frozenset()) -> bool:
    """The query reads a series a CPU run of the example cannot have (NOT_FROM_A_CPU_RUN,
    or a recording rule over one) and, where it has `or` fallbacks, nothing else but
    the denominators."""
    impossible = impossible or IMPOSSIBLE
    names = {q.metric_name(s) for s in q.selectors(expr)}
    return bool(names & impossible) and (" or " not in expr or not names - impossible - DENOMINATORS)


IMPOSSIBLE = set(NOT_FROM_A_CPU_RUN)
IMPOSSIBLE |= {r["record"] for r in RECORDS if _cpu_impossible(r["expr"], IMPOSSIBLE)}


def test_every_rule_group_is_healthy(stack):
    groups = stack.prometheus.rules()
    assert groups
    bad = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r.get("health") != "ok"]
    assert not bad, bad


@pytest.mark.parametrize("rule", RECORDS, ids=[r["record"] for r in RECORDS])
def test_recording_rule_has_data(stack, rule):
    if _cpu_impossible(rule["expr"]):
        pytest.skip(f"over {sorted({q.metric_name(s) for s in q.selectors(rule['expr'])})}: not from a CPU run")
    result = stack.prometheus.query(f'{rule["record"]}{{job="{HEALTHY}"}}')
    assert result and _finite(result), f"{rule['record']}: nothing recorded for {HEALTHY}"


def _time_interval() -> str:
    """The Prometheus data source's ``timeInterval`` (Grafana's scrape interval)."""
    path = ROOT / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
    (prom,) = [d for d in yaml.safe_load(path.read_text())["datasources"] if d["type"] == "prometheus"]
    return prom["jsonData"]["timeInterval"]


def _range_s(dashboard: dict) -> int:
    m = re.fullmatch(r"now-(\d+)([smhd])", dashboard["time"]["from"])
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


@pytest.mark.parametrize("dash, panel, target", TARGETS, ids=[f"{d}:{p['title']}:{t['refId']}" for d, p, t in TARGETS])
def test_panel_target_returns_data(stack, dash, panel, target):
    """Each target as Grafana sends it when the dashboard opens on its default range just
    after the healthy run ended: variables substituted, the step, $__interval,
    $__rate_interval and $__range from Grafana's interval rules (tests/stack/grafana.py).
    "Just after": once the end Grafana aligns down to a multiple of the step lies past
    the moment every point was stored and recorded, whatever the run's length (a quiet
    machine trains it in seconds, and recorded series begin only with the rule
    evaluation after the points arrive)."""
    if _cpu_impossible(target["expr"]):
        pytest.skip("over series a CPU run cannot have")
    while True:
        plan = grafana.plan(_range_s(q.dashboards()[dash]), time.time(),
                            panel.get("maxDataPoints") or grafana.panel_width_px(panel), _time_interval(),
                            panel.get("interval"), target.get("interval"))
        if plan.end >= stack.settled:
            break
        time.sleep(1)  # the dashboard opened too soon: its aligned end is before the data settled
    expr = q.substitute(grafana.interpolate(target["expr"], plan), _values(stack))
    if target.get("instant"):
        result = stack.prometheus.query(expr, plan.end)
    else:
        result = stack.prometheus.query_range(expr, plan.start, plan.end, plan.step_ms / 1000)
    assert result and _finite(result), f"no data (step {plan.step_ms} ms, end {plan.end}): {expr}"


def test_the_idle_gpu_fires_the_low_utilization_alert_into_alertmanager(stack):
    got = wait_for(lambda: [a for a in stack.webhook.alerts("/warning")
                            if a["labels"]["alertname"] == "TrainingGPUUtilizationLow"], 60)
    assert got, stack.webhook.received
    assert {a["labels"]["hw_id"] for a in got} == {"GPU-11111111-0000-0000-0000-000000000000",
                                                   "GPU-11111111-0000-0000-0000-000000000001"}


# Alerts whose condition this short healthy run can never meet, whatever the machine's
# load: for them even a pending alert is a false positive. (A straggler, goodput or memory
# trend over a minute of a loaded 2-core machine says nothing; for those, only firing is.)
NEVER_PENDING = {"TrainingGPUUtilizationLow", "GPUMemoryNearlyFull", "TrainingDataLoadingBound",
                 "TrainingStalled", "TrainingTelemetryAbsent", "TrainingTelemetryExportFailing",
                 "TrainingTelemetryDropped"}


def test_the_healthy_run_fires_no_alert(stack):
    """Nothing reached the webhook for the busy GPUs or the healthy job; at the run's end
    no alert fires for them, and none of NEVER_PENDING is even pending (the
    low-utilization alert fires at once)."""
    wait_for(lambda: stack.webhook.alerts("/warning"), 60)  # the idle run's alert went through
    busy = re.compile(r"GPU-0000")
    for path in ("/critical", "/warning", "/info"):
        for alert in stack.webhook.alerts(path):
            labels = alert["labels"]
            assert labels.get("job") != HEALTHY and not busy.match(labels.get("hw_id", "")), alert
    for alert in stack.prometheus.alerts():
        labels = alert["labels"]
        if alert["state"] == "firing" or labels["alertname"] in NEVER_PENDING:
            assert labels.get("job") != HEALTHY and not busy.match(labels.get("hw_id", "")), alert
    assert NEVER_PENDING <= {r["alert"] for r in RULES if "alert" in r}


# --- traces ----------------------------------------------------------------------------------

def test_each_step_time_exemplar_resolves_to_its_steps_trace(stack):
    now = time.time()
    data = stack.prometheus.exemplars(f'training_step_duration_seconds_bucket{{job="{HEALTHY}"}}',
                                      stack.started - 60, now + 60)
    exemplars = [e for series in data for e in series["exemplars"]]
    assert exemplars, "no exemplars on the step-time histogram"
    for exemplar in exemplars:
        trace_id, span_id = exemplar["labels"]["trace_id"], exemplar["labels"]["span_id"]
        spans = wait_for(lambda t=trace_id: stack.jaeger.trace(t), 20)
        assert spans, f"trace {trace_id} is not in the trace store"
        (step,) = [s for s in spans if s["spanID"] == span_id]
        assert step["operationName"] == "step"
        children = {s["operationName"] for s in spans
                    if any(r["spanID"] == span_id for r in s.get("references", []))}
        assert {"dataloader_next", "to_device", "train_batch"} <= children, children


def test_the_runs_traces_are_found_by_service_and_run_id(stack):
    run_id = _values(stack)["training_run_id"]
    assert HEALTHY in stack.jaeger.services()
    traces = stack.jaeger.find(HEALTHY, {"training.run.id": run_id})
    assert traces
    steps = [s for t in traces for s in t["spans"] if s["operationName"] == "step"]
    assert steps and len(traces) >= 2
    other = stack.jaeger.find(HEALTHY, {"training.run.id": "not-this-run"})
    assert not other


# --- the stack's own metrics, and a stopped Collector -------------------------------------------

def test_the_collectors_own_metrics_reach_prometheus(stack):
    up = stack.prometheus.query('up{job="otel-collector"}')
    assert [float(r["value"][1]) for r in up] == [1.0]
    accepted = stack.prometheus.query('sum(otelcol_receiver_accepted_metric_points_total{job="otel-collector"})')
    assert accepted and float(accepted[0]["value"][1]) > 0
    assert stack.prometheus.query('otelcol_exporter_sent_spans_total{job="otel-collector"}')
    # the names the TelemetryCollector* alerts read (refused: 0 while healthy, but present)
    for name in ("otelcol_receiver_refused_metric_points_total", "otelcol_receiver_refused_spans_total"):
        assert stack.prometheus.query(f'{name}{{job="otel-collector"}}'), name


def test_stack_status_reports_every_service(stack):
    report = stack.status()["services"]
    assert {k: v["state"] for k, v in report.items() if k in ("otel-collector", "prometheus", "alertmanager",
                                                               "tempo")} == dict.fromkeys(
        ("otel-collector", "prometheus", "alertmanager", "tempo"), "healthy")
    assert report["grafana"]["state"] == "not started" and "Docker" in report["grafana"]["note"]
    assert report["prometheus"]["url"] == stack.prometheus.url
    assert "Jaeger" in report["tempo"]["note"]


def test_zz_a_stopped_collector_fires_its_alert(stack):
    """Runs last in the module: it stops the stack's Collector."""
    pid = stack.status()["services"]["otel-collector"]["pid"]
    os.kill(pid, 15)
    got = wait_for(lambda: [a for a in stack.webhook.alerts("/critical")
                            if a["labels"]["alertname"] == "TelemetryCollectorDown"], 60)
    assert got and got[0]["labels"]["job"] == "otel-collector"
    assert stack.status()["services"]["otel-collector"]["state"] == "stopped"
