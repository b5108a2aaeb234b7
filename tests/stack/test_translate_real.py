"""``prom_translate.py`` against the real translation: the same OTLP export (a real
two-rank instrumented run, as captured in conftest.py) posted to Prometheus 3's own OTLP
receiver, with the shipped prometheus.yml's ``otlp`` settings, and translated by the
emulation that the backfilled stack tests use. Every series (name and labels) and
every last value must agree, or the emulated tests would test names nobody stores."""

from __future__ import annotations

import math
import time

import pytest

from tests.stack.promserver import Prometheus, stack_config
from tests.stack.realstack import RemotePrometheus, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def otlp_prometheus(prom_bin, run_data, tmp_path_factory):
    prom = Prometheus(prom_bin, tmp_path_factory.mktemp("otlp-prometheus"))
    # Ingestion only: no rules, so that no series of Prometheus's own joins the run's (the
    # recorded series, or ALERTS once an evaluation finds the planted data wait: on a
    # loaded machine one came before the comparison)
    config = stack_config()
    config["rule_files"] = []
    prom.start(config, extra_args=["--web.enable-otlp-receiver"])
    remote = RemotePrometheus(prom.url)
    try:
        for request in run_data.real_requests:
            assert remote.post_otlp(request.SerializeToString()) in (200, 204)
        yield remote
    finally:
        prom.stop()


def _emulated(run_data, job: str) -> dict:
    out = {}
    for fam in run_data.real.families.values():
        for key, points in fam.samples.items():
            labels = dict(key[1:])
            if labels.get("job") == job:
                out[(key[0], frozenset(labels.items()))] = float(points[max(points)])
    return out


def test_the_emulation_names_every_series_as_prometheus_stores_it(otlp_prometheus, run_data):
    job = run_data.real_values["job"]
    emulated = {labels | {("__name__", name)} for name, labels in _emulated(run_data, job)}
    real = wait_for(lambda: {frozenset(s.items()) for s in otlp_prometheus.series(f'{{job="{job}"}}')}, 30)
    real_names, emulated_names = ({dict(s)["__name__"] for s in x} for x in (real, emulated))
    assert real_names == emulated_names, (
        f"only in Prometheus: {sorted(real_names - emulated_names)}; "
        f"only in the emulation: {sorted(emulated_names - real_names)}")
    assert real == emulated, (
        f"only in Prometheus: {sorted(map(sorted, real - emulated))[:3]}; "
        f"only in the emulation: {sorted(map(sorted, emulated - real))[:3]}")


def test_the_emulation_keeps_every_last_value(otlp_prometheus, run_data):
    job = run_data.real_values["job"]
    emulated = _emulated(run_data, job)
    now = time.time()
    wrong = []
    for (name, labels), value in emulated.items():
        selector = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels)) + "}"
        result = otlp_prometheus.query(f"last_over_time({selector}[1h])", now)
        got = float(result[0]["value"][1]) if result else None
        if got is None or not (math.isclose(got, value, rel_tol=1e-9) or (math.isnan(got) and math.isnan(value))):
            wrong.append((selector, got, value))
    assert not wrong, wrong[:5]
