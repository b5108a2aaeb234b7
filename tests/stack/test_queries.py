"""Every PromQL query of every dashboard panel, dashboard variable, recording and alert rule
and Tempo trace-to-metrics link, executed against a real Prometheus 3 that holds a real
instrumented training run (two torchrun ranks of examples/train_basic.py under
opentelemetry-instrument, OTLP-exported and stored under Prometheus 3's names; see
conftest.py). Each must return data.

A healthy run on a CPU machine cannot produce a few series (listed below); queries on
them are answered by the synthetic producer (real SDK and OTLP exporter, contract
names) loaded into the same Prometheus, and say so when they fail.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from tests.stack import promql as q
from tests.stack.promserver import ROOT, Prometheus, stack_config

pytestmark = pytest.mark.slow

NOT_IN_A_HEALTHY_CPU_RUN = {
    "training_gpu_idle_seconds_total": "GPU idle time needs CUDA device timing",
    "job_run_rank_phase:training_gpu_idle_seconds:share5m": "derived from training_gpu_idle_seconds_total",
    "training_telemetry_export_failures_total": "counted only when an export fails",
    "training_telemetry_spans_dropped_total": "counted only when spans are dropped",
    "training_telemetry_steps_dropped_total": "counted only when steps are dropped",
    "training_tokens_total": "the example trains on float features, not token ids",
    "job_run_rank:training_tokens:rate5m": "derived from training_tokens_total",
    "training_memory_allocated_bytes": "CUDA allocator statistics need CUDA",
    "training_memory_peak_allocated_bytes": "CUDA allocator statistics need CUDA",
    "training_memory_peak_reserved_bytes": "CUDA allocator statistics need CUDA",
    "training_memory_alloc_retries_total": "CUDA allocator statistics need CUDA",
    "training_memory_ooms_total": "CUDA allocator statistics need CUDA",
}


def _source(expr: str) -> str:
    names = {q.metric_name(s) for s in q.selectors(expr)}
    return "synthetic" if names & set(NOT_IN_A_HEALTHY_CPU_RUN) else "real"


def _values(run_data, source: str) -> dict:
    return run_data.real_values if source == "real" else run_data.synthetic_values


def _finite(result: list) -> bool:
    for series in result:
        points = series.get("values") or [series["value"]]
        if any(math.isfinite(float(v)) for _, v in points):
            return True
    return False


def _start(run_data) -> float:
    return min(run_data.real.time_range_ms()[0], run_data.synthetic.time_range_ms()[0]) / 1000 - 60


TARGETS = [(name, panel, target) for name, dash in q.dashboards().items()
           for panel, target in q.panel_queries(dash)]
VARIABLES = [(name, var) for name, dash in q.dashboards().items() for var in q.variables(dash)]
RULES = list(q.rules())
RECORDS = [r for r in RULES if "record" in r]
ALERTS = [r for r in RULES if "alert" in r]


def _rule_id(rule: dict) -> str:
    return rule.get("alert") or rule["record"]


@pytest.mark.parametrize("dash, panel, target", TARGETS,
                         ids=[f"{d}:{p['title']}:{t['refId']}" for d, p, t in TARGETS])
def test_dashboard_query_returns_data(prometheus, run_data, dash, panel, target):
    source = _source(target["expr"])
    expr = q.substitute(target["expr"], _values(run_data, source))
    now = time.time()
    if target.get("instant"):
        result = prometheus.query(expr, now)
    else:
        result = prometheus.query_range(expr, _start(run_data), now, 1)
    assert result and _finite(result), f"no data from the {source} run: {expr}"


@pytest.mark.parametrize("dash, var", VARIABLES, ids=[f"{d}:{v['name']}" for d, v in VARIABLES])
def test_dashboard_variable_lists_the_runs_value(prometheus, run_data, dash, var):
    selector, label = q.label_values_call(q.variable_query(var))
    values = run_data.real_values
    got = prometheus.label_values(label, q.substitute(selector, values), _start(run_data), time.time())
    assert values[label] in got, f"{label}: {got}"


@pytest.mark.parametrize("rule", RECORDS, ids=[_rule_id(r) for r in RECORDS])
def test_recording_rule_records_the_run(prometheus, run_data, rule):
    source = _source(rule["record"])
    job = _values(run_data, source)["job"]
    result = prometheus.query(f'{rule["record"]}{{job={json.dumps(job)}}}')
    assert result and _finite(result), f"nothing recorded for the {source} run"


@pytest.mark.parametrize("rule", RULES, ids=[_rule_id(r) for r in RULES])
def test_rule_selectors_match_the_run(prometheus, run_data, rule):
    for selector in q.selectors(rule["expr"]):
        if q.metric_name(selector) in q.STACK_COMPONENT_METRICS:
            continue  # the Collector's and Prometheus's own series: test_alertmanager.py, promtool
        source = _source(selector)
        job = _values(run_data, source)["job"]
        expr = f"count(last_over_time({q.with_matcher(selector, f'job={json.dumps(job)}')}[1h]))"
        assert prometheus.query(expr), f"{selector} matches nothing in the {source} run"


@pytest.mark.parametrize("rule", ALERTS, ids=[_rule_id(r) for r in ALERTS])
def test_alert_expression_evaluates(prometheus, rule):
    prometheus.query(rule["expr"])  # PromError on anything Prometheus rejects


def test_the_runs_planted_data_bottleneck_meets_the_alert_condition(prometheus, run_data):
    """train_basic.py sleeps 20 ms per batch in its Dataset: every rank is data-loading bound."""
    rule = next(r for r in ALERTS if r["alert"] == "TrainingDataLoadingBound")
    job = run_data.real_values["job"]
    ranks = {r["metric"].get("training_rank") for r in prometheus.query(rule["expr"])
             if r["metric"]["job"] == job}
    assert ranks == {"0", "1"}


def test_telemetry_absent_stays_silent_for_the_healthy_run(prometheus, run_data):
    """The run's instrumented torchrun launcher exports without training steps: not an alert."""
    rule = next(r for r in ALERTS if r["alert"] == "TrainingTelemetryAbsent")
    job = run_data.real_values["job"]
    assert not [r for r in prometheus.query(rule["expr"]) if r["metric"]["job"] == job]

def test_tempo_links_back_to_the_runs_metrics(prometheus, run_data):
    path = ROOT / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
    tempo = next(d for d in yaml.safe_load(path.read_text())["datasources"] if d["type"] == "tempo")
    links = tempo["jsonData"]["tracesToMetrics"]
    values = run_data.real_values
    tags = ", ".join(f'{t["value"]}="{values[t["value"]]}"' for t in links["tags"])
    for link in links["queries"]:
        expr = link["query"].replace("$$__tags", tags)
        result = prometheus.query(expr)
        assert result and _finite(result), expr


# --- exemplars: scraped (blocks carry none), from the run's final exposition ---------------

@pytest.fixture(scope="module")
def exemplar_prometheus(prom_bin, run_data, tmp_path_factory):
    body = run_data.real.openmetrics(timestamps=False).encode()

    class Exposition(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "application/openmetrics-text; version=1.0.0; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Exposition)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prom = Prometheus(prom_bin, tmp_path_factory.mktemp("exemplars"))
    try:
        prom.start(stack_config([f"127.0.0.1:{server.server_address[1]}"]))
        deadline = time.monotonic() + 30
        while not prom.query("training_step_duration_seconds_bucket") and time.monotonic() < deadline:
            time.sleep(0.5)
        yield prom
    finally:
        prom.stop()
        server.shutdown()


def test_heatmap_exemplars_open_the_runs_traces(exemplar_prometheus, run_data):
    (_, _, target), = [t for t in TARGETS if t[1]["type"] == "heatmap"]
    expr = q.substitute(target["expr"], run_data.real_values)
    now = time.time()
    data = exemplar_prometheus.exemplars(expr, now - 3600, now + 60)
    trace_ids = {e["labels"]["trace_id"] for series in data for e in series["exemplars"]}
    assert trace_ids, f"no exemplars for {expr}"
    assert trace_ids <= run_data.trace_ids  # each one names a trace the run exported
