"""Two runs of one job training at the same time on one host (a sweep) stay apart on
every panel of the Training dashboard, and on the per-process panels of the Hardware one.

The data: two real torchrun jobs started together (tests/stack/real_run.py, CONCURRENT:
one waits 20 ms per batch for data, the other 2 ms), in the real Prometheus of
conftest.py evaluating the repository's recording rules. With Run = All, every series
a panel shows must belong to one run and hold exactly the value that panel shows when
only that run is selected: no sum, max or average across runs. Panels Grafana repeats
per run (stacked phases, heatmaps) are one copy per run, each with its own data.
"""

from __future__ import annotations

import math
import time

import pytest
import yaml

from tests.stack import grafana
from tests.stack import promql as q
from tests.stack.promserver import ROOT

pytestmark = pytest.mark.slow

DATASOURCES = ROOT / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
# Per host or per GPU, shared by every run on it: hardware is not a run's.
HARDWARE_PER_PROCESS = ("process_gpu_",)


def _time_interval() -> str:
    ds = next(d for d in yaml.safe_load(DATASOURCES.read_text())["datasources"] if d["type"] == "prometheus")
    return ds["jsonData"].get("timeInterval", "")


def _per_run_targets():
    out = []
    for name, dash in q.dashboards().items():
        for panel, target in q.panel_queries(dash):
            if name == "hardware" and not any(p in target["expr"] for p in HARDWARE_PER_PROCESS):
                continue
            out.append((name, dash, panel, target))
    return out


TARGETS = _per_run_targets()


def _evaluate(prometheus, panel, target, values, at):
    plan = grafana.plan(3600, at, grafana.panel_width_px(panel), _time_interval())
    expr = q.substitute(grafana.interpolate(target["expr"], plan), values)
    out = {}
    for series in prometheus.query(expr, at):
        value = float(series["value"][1])
        if math.isfinite(value):
            out[tuple(sorted(series["metric"].items()))] = value
    return out


SYNTHETIC_ONLY = {"training_gpu_idle_seconds_total", "job_run_rank_phase:training_gpu_idle_seconds:share5m",
                  "job_run_rank:training_tokens:rate5m",
                  "training_tokens_total", "training_memory_allocated_bytes", "training_memory_peak_allocated_bytes",
                  "training_memory_peak_reserved_bytes", "training_memory_alloc_retries_total",
                  "training_memory_ooms_total"}


def _values(job: str) -> dict:
    return {"job": job, "training_run_id": q.ALL, "host_name": q.ALL, "training_rank": q.ALL, "gpu_index": q.ALL}


@pytest.fixture(scope="module")
def both_runs(prometheus, run_data):
    """(runs, variable values, when) of the real runs; "synthetic": of the synthetic ones
    (GPU idle time needs CUDA device timing, which a CPU run cannot have)."""
    at = time.time()
    out = {"real": (run_data.real_runs, _values(run_data.real_values["job"]), at),
           "synthetic": (run_data.synthetic_runs, _values(run_data.synthetic_values["job"]), at)}
    for runs, _, _ in out.values():
        assert len(runs) == 2, runs
    return out


def test_the_two_runs_trained_at_once_on_one_host(prometheus, run_data, both_runs):
    runs, values, at = both_runs["real"]
    job = values["job"]
    spans = {}
    for run in runs:
        sel = f'training_steps_total{{job="{job}", training_run_id="{run}"}}'
        stamps = [float(t) for s in prometheus.query_range(f"max({sel})", at - 600, at, 0.1) for t, _ in s["values"]]
        spans[run] = (min(stamps), max(stamps))
    (a0, a1), (b0, b1) = spans.values()
    assert max(a0, b0) < min(a1, b1)  # they overlap in time
    hosts = {s["metric"]["host_name"] for s in prometheus.query(f'count by (host_name) (training_steps_total{{job="{job}"}})', at)}
    assert len(hosts) == 1
    # the Run variable lists both
    var = next(v for v in q.variables(q.dashboards()["training"]) if v["name"] == "training_run_id")
    selector, label = q.label_values_call(q.variable_query(var))
    assert set(runs) <= set(prometheus.label_values(label, q.substitute(selector, values), at - 3600, at))


def test_the_runs_differ_so_a_blend_would_show(prometheus, both_runs):
    runs, values, at = both_runs["real"]
    shares = {}
    for run in runs:
        result = prometheus.query(
            f'avg(job_run_rank_phase:training_phase_duration_seconds:share5m{{job="{values["job"]}", '
            f'training_run_id="{run}", training_phase="dataloader_next"}})', at)
        shares[run] = float(result[0]["value"][1])
    low, high = sorted(shares.values())
    assert high - low > 0.1, shares  # 20 ms against 2 ms of data wait per batch


@pytest.mark.parametrize("name, dash, panel, target", TARGETS,
                         ids=[f"{n}:{p['title']}:{t['refId']}" for n, _, p, t in TARGETS])
def test_no_panel_blends_the_runs(prometheus, both_runs, name, dash, panel, target):
    source = "synthetic" if {q.metric_name(s) for s in q.selectors(target["expr"])} & SYNTHETIC_ONLY else "real"
    runs, values, at = both_runs[source]
    alone = {}

    def run_alone(run):
        if run not in alone:
            alone[run] = _evaluate(prometheus, panel, target, {**values, "training_run_id": run}, at)
        return alone[run]

    for run in runs:
        assert run_alone(run), f"no data for run {run} alone"
    if q.repeat_variable(dash, panel) == "training_run_id":
        # Grafana draws one copy per selected run, each with that run alone: its series
        # are that run's (above); the copies differ, since the runs do.
        assert run_alone(runs[0]) != run_alone(runs[1])
        return
    together = _evaluate(prometheus, panel, target, values, at)
    for labels, value in together.items():
        run = dict(labels).get("training_run_id")
        # (on the Hardware dashboard a run may also be an instrumented torchrun
        # launcher's own run id: a run of its own, alone like any other)
        assert run, f"a series of no single run (Run = All): {dict(labels)}"
        assert labels in run_alone(run), f"{dict(labels)} is not what run {run} alone shows"
        assert math.isclose(value, run_alone(run)[labels], rel_tol=1e-9, abs_tol=1e-12), (
            f"{dict(labels)}: {value} with Run = All, {run_alone(run)[labels]} for run {run} alone")
    assert set(runs) <= {dict(k).get("training_run_id") for k in together}
