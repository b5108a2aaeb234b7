"""tests/stack/grafana.py's frontend interval rules against Grafana's own code: the
rangeutil and datemath of ``@grafana/data`` (npm, Apache-2.0) at the compose file's
Grafana version, run by node (one process for the module) on a grid that holds every
value the dashboards use: their time ranges, the panels' widths (their default
maxDataPoints) and maxDataPoints, the panels' min intervals and the data source's
``timeInterval``. The backend half (Go, promlib) is not on npm: test_grafana_intervals.py
checks it against the values of Grafana's Go tests."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from tests.stack import grafana as g
from tests.stack import grafana_npm
from tests.stack import promql as q
from tests.stack.promserver import ROOT

DATASOURCES = ROOT / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
NOW = 1_700_000_000_123  # ms; any fixed instant, so the calendar ranges are reproducible
SCREENS_PX = (1280, 1920, 2560, 3840)
# The time picker's relative ranges (rangeutil's standard options) and two calendar ones.
PICKER_RANGES = [(f"now-{r}", "now") for r in ("5m", "15m", "30m", "1h", "3h", "6h", "12h", "24h", "2d", "7d",
                                               "30d", "90d", "6M", "1y", "2y", "5y")] + [("now/d", "now/d"),
                                                                                        ("now/w", "now")]
# Interval strings a panel's "Min interval" or timeInterval may hold, the unusual ones too.
LOW_LIMITS = [None, "", "1s", "5s", "10s", "15s", "30s", "1m", "1m30s", "1.5m", "500ms", "10", "2w", "1M", "1y"]
INTERVAL_TEXTS = LOW_LIMITS[2:] + ["0", "0s", "-5", "5", " 15 ", "0.5", ".5", "1e3", "+5", "5.", "10sx", "3.7h",
                                   "-1.5m", "1d", "1h", "ms", "abc", "1ms"]
BOUNDS = [b for b, _ in g._ROUND]


def _time_interval() -> str:
    ds = next(d for d in yaml.safe_load(DATASOURCES.read_text())["datasources"] if d["type"] == "prometheus")
    return ds["jsonData"].get("timeInterval", "")


def _dashboard_cases():
    """(dashboard, panel title, range, maxDataPoints, panel's min interval) for every query
    panel at each screen width, over the dashboard's own range and the time picker's."""
    out = []
    for name, dash in q.dashboards().items():
        ranges = [(dash["time"]["from"], dash["time"]["to"])]
        ranges += [(o["from"], o["to"]) for o in dash.get("timepicker", {}).get("quick_ranges", [])]
        for panel in q.panels(dash):
            if not panel.get("targets"):
                continue
            widths = ([panel["maxDataPoints"]] if "maxDataPoints" in panel
                      else sorted({g.panel_width_px(panel, px) for px in SCREENS_PX}))
            for rng in ranges + PICKER_RANGES:
                for width in widths:
                    out.append((name, panel["title"], rng, width, panel.get("interval")))
    return out


DASHBOARD_CASES = _dashboard_cases()
# The frontend's low limit: the panel's min interval, else the Prometheus data source's
# `interval`, its timeInterval (15s when unset).
DS_INTERVAL = _time_interval() or g.DEFAULT_SCRAPE
ROUND_CASES = [0, 0.5, 1, 9.999] + [x for b in BOUNDS for x in (b - 1, b - 0.001, b, b + 0.001, b + 1)] + [1e12]
HMS_CASES = [0, 0.0005, 0.001, 0.999, 1, 59.999, 60, 90, 3599, 3600, 86399, 86400, 90061.5, 31535999,
             31536000, 1e9, -0.5, -1] + [v / 1000 for _, v in g._ROUND]
# The grid: the dashboards' ranges and widths x every low limit, and each rounding bound
# hit exactly by range / resolution.
CALCULATE_CASES = sorted({(rng, width, low) for _, _, rng, width, _ in DASHBOARD_CASES
                          for low in LOW_LIMITS + [DS_INTERVAL]},
                         key=repr)
CALCULATE_CASES += [(b * res + d, res, low) for b in BOUNDS for d in (-1, 0, 1)
                    for res in (1, 900, 11000) for low in (None, "15s")]


@pytest.fixture(scope="module")
def grafana_data():
    """@grafana/data's answers for every case of this module."""
    grafana_npm.require_packages()
    payload = {"now": NOW, "round": ROUND_CASES, "intervalToMs": INTERVAL_TEXTS, "secondsToHms": HMS_CASES,
               "calculate": [[list(r) if isinstance(r, tuple) else r, res, low] for r, res, low in CALCULATE_CASES]
               + [[list(rng), width, interval or DS_INTERVAL] for _, _, rng, width, interval in DASHBOARD_CASES]}
    out = grafana_npm.run_node("rangeutil.cjs", payload)
    assert out["version"] == grafana_npm.PINNED["@grafana/data"]
    out["dashboard"] = out["calculate"][len(CALCULATE_CASES):]
    out["calculate"] = out["calculate"][:len(CALCULATE_CASES)]
    return out


def _ours(fn, *args) -> dict:
    """grafana.py's answer in the node script's form: {value} or {error}."""
    try:
        value = fn(*args)
    except ValueError as e:
        return {"error": str(e)}
    return {"value": "NaN" if isinstance(value, float) and math.isnan(value) else value}


def _same(ours: dict, theirs: dict) -> bool:
    if "error" in ours or "error" in theirs:
        return ("error" in ours) == ("error" in theirs)  # both refuse the input
    return ours["value"] == theirs["value"]


def _mismatches(cases, fn, answers):
    return [(case, ours, theirs) for case, theirs in zip(cases, answers, strict=True)
            if not _same(ours := _ours(fn, *(case if isinstance(case, tuple) else (case,))), theirs)]


def test_compose_grafana_is_the_pinned_npm_version():
    """The npm packages are Grafana's own at the version docker-compose.yml runs."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    image = compose["services"]["grafana"]["image"]
    assert image.startswith("grafana/grafana:")
    version = image.split(":", 1)[1]
    lock = json.loads((grafana_npm.PACKAGE_JSON.parent / "package-lock.json").read_text())["packages"]
    for name in ("@grafana/data", "@grafana/schema"):
        assert grafana_npm.PINNED[name] == version, (name, grafana_npm.PINNED[name], image)
        assert lock[f"node_modules/{name}"]["version"] == version, name
    assert lock[""]["dependencies"] == grafana_npm.PINNED  # the lock is the package.json's


def test_round_interval(grafana_data):
    assert not _mismatches(ROUND_CASES, g.round_interval_frontend, grafana_data["round"])


def test_round_interval_backend_differs_at_the_bounds(grafana_data):
    """The check can tell the two halves apart: Go's RoundInterval (<=) is not the frontend's."""
    differ = [b for b, theirs in zip(ROUND_CASES, grafana_data["round"], strict=True)
              if b in BOUNDS[1:-1] and g.round_interval_backend(b) != theirs["value"]]
    assert differ == BOUNDS[1:-1]


def test_interval_to_ms(grafana_data):
    assert not _mismatches(INTERVAL_TEXTS, g.interval_to_ms, grafana_data["intervalToMs"])
    # the frontend reads one number and unit; the backend's reading (Go) sums "1m30s"
    theirs = dict(zip(INTERVAL_TEXTS, grafana_data["intervalToMs"], strict=True))
    assert theirs["1m30s"] == {"value": 60000} != {"value": g.parse_ms("1m30s")}


def test_seconds_to_hms(grafana_data):
    assert not _mismatches(HMS_CASES, g.seconds_to_hms, grafana_data["secondsToHms"])


def test_calculate_interval(grafana_data):
    bad = []
    for (rng, res, low), theirs in zip(CALCULATE_CASES, grafana_data["calculate"], strict=True):
        value = theirs["value"]
        ours = g.calculate_interval(value["rangeMs"], res, low)
        if ours != (value["intervalMs"], value["interval"]):
            bad.append((rng, res, low, ours, value))
    assert not bad, bad[:10]
    assert len(CALCULATE_CASES) > 1000


def test_every_dashboard_panel_gets_grafanas_frontend_interval(grafana_data):
    """plan() (what test_queries / test_concurrent_runs / test_export_intervals run) takes
    the interval @grafana/data computes for each panel, range and screen width."""
    time_interval, bad = _time_interval(), []
    for (name, title, rng, width, interval), theirs in zip(DASHBOARD_CASES, grafana_data["dashboard"], strict=True):
        value = theirs["value"]
        plan = g.plan(value["rangeMs"] / 1000, NOW / 1000, width, time_interval, interval)
        if plan.interval_ms != value["intervalMs"]:
            bad.append((name, title, rng, width, interval, plan.interval_ms, value["intervalMs"]))
    assert not bad, bad[:10]


def test_dashboards_open_on_the_range_the_stack_tests_plan_for(grafana_data):
    """Both dashboards open on the last hour: 3600 s, the range test_concurrent_runs.py plans."""
    opens_on = {name: (d["time"]["from"], d["time"]["to"]) for name, d in q.dashboards().items()}
    opening = {(name, rng): theirs["value"]["rangeMs"]
               for (name, _, rng, _, _), theirs in zip(DASHBOARD_CASES, grafana_data["dashboard"], strict=True)
               if rng == opens_on[name]}
    assert set(opening.values()) == {3_600_000}, opening
