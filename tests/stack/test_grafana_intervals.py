"""tests/stack/grafana.py reproduces Grafana's interval rules: checked against the values
Grafana's own tests (pkg/promlib/models/query_test.go, grafana-data rangeutil) expect."""

from __future__ import annotations

import pytest

from tests.stack import grafana as g


@pytest.mark.parametrize("ms, frontend, backend", [
    (319, 200, 200), (350, 500, 200), (3600000 / 940, 5000, 5000), (1500, 2000, 1000),
    (90000, 120000, 60000), (92000, 120000, 120000), (86400000 / 1500, 60000, 60000),
])
def test_round_interval_bounds(ms, frontend, backend):
    # the frontend's bounds are strict (<), the backend's inclusive (<=)
    assert g.round_interval_frontend(ms) == frontend
    assert g.round_interval_backend(ms) == backend


def test_rate_interval_is_the_interval_plus_the_scrape_interval_or_four_scrapes():
    # Grafana's test: 48 h range, frontend interval 2m, scrape 15s -> [2m15s]
    q = g.plan(48 * 3600, 1_700_000_000, max_data_points=1440, time_interval="15s")
    assert q.interval_ms == 120000 and q.rate_interval == "2m15s"
    # Grafana's test: min step "5m" on the target over 5 minutes -> [20m0s]
    q = g.plan(300, 1_700_000_000, max_data_points=1500, time_interval="15s", target_interval="5m")
    assert q.rate_interval == "20m0s"
    # short ranges: 4 x the data source's scrape interval
    assert g.plan(900, 1_700_000_000, 1000, "5s").rate_interval == "20s"
    assert g.plan(900, 1_700_000_000, 1000, "15s").rate_interval == "1m0s"
    assert g.plan(900, 1_700_000_000, 1000, None).rate_interval == "1m0s"  # unset: 15s


def test_step_is_at_least_the_time_interval_and_aligned():
    q = g.plan(3600, 1_700_000_007, max_data_points=900, time_interval="15s")
    assert q.step_ms == 15000 and q.interval == "15s" and q.range == "3600s"
    assert q.end % 15 == 0 and q.start % 15 == 0 and q.end <= 1_700_000_007
    # a long range: the rounded range / width wins over the minimum
    q = g.plan(7 * 86400, 1_700_000_000, max_data_points=900, time_interval="15s")
    assert q.step_ms == 600000 and q.interval == "10m" and q.rate_interval == "10m15s"


@pytest.mark.parametrize("ms, text", [(60000, "1m0s"), (135000, "2m15s"), (20000, "20s"),
                                      (3600000, "1h0m0s"), (3615000, "1h0m15s"), (500, "500ms")])
def test_go_duration(ms, text):
    assert g.go_duration(ms) == text


def test_interpolate_keeps_the_rest_of_the_query():
    q = g.plan(900, 1_700_000_000, 1000, "15s")
    expr = "rate(x[$__rate_interval]) or rate(x[5m]) + y[${__interval}] + z[$__range]"
    assert g.interpolate(expr, q) == "rate(x[1m0s]) or rate(x[5m]) + y[15s] + z[900s]"
