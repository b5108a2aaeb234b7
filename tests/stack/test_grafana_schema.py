"""The shipped dashboards against the types Grafana publishes under Apache-2.0, and the
provisioning files against the keys Grafana documents; unknown fields are refused.

tests/stack/npm/schema.cjs reads the types with the TypeScript compiler (the version
@grafana/schema builds with) and checks each file strictly; tests/stack/npm/dashboard.ts
says which type checks which part, and holds the short allowlist of what Grafana reads but
publishes no Apache-2.0 type for; tests/stack/npm/provisioning.ts transcribes the
provisioning docs (Grafana publishes no machine-readable schema for those files). One
node process answers the module; planted faults in copies of the files show each kind of
mismatch is refused.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from tests.stack import grafana_npm
from tests.stack.promserver import ROOT

NPM = grafana_npm.SCRIPTS
DASHBOARDS = {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "grafana" / "dashboards").glob("*.json"))}
PROVISIONING = {
    "datasources": (ROOT / "grafana" / "provisioning" / "datasources" / "datasources.yaml", "DataSourcesFile"),
    "dashboards": (ROOT / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml", "DashboardsFile"),
}
FILES = {name: (NPM / name).read_text() for name in ("dashboard.ts", "provisioning.ts")}


def _panel(dash: dict, kind: str) -> dict:
    return next(p for p in dash["panels"] if p["type"] == kind)


def _set(path: str, value):
    """A fault: set ``path`` (keys and list indexes, dot-separated) to ``value``."""
    def plant(doc):
        *parents, last = path.split(".")
        for key in parents:
            doc = doc[int(key)] if isinstance(doc, list) else doc[key]
        if value is _DELETE:
            del doc[last]
        else:
            doc[int(last) if isinstance(doc, list) else last] = value
    return plant


_DELETE = object()
T = "training"
_TRAINING = DASHBOARDS[T]
_TS = _TRAINING["panels"].index(_panel(_TRAINING, "timeseries"))
_STAT = _TRAINING["panels"].index(_panel(_TRAINING, "stat"))
_TABLE = _TRAINING["panels"].index(_panel(_TRAINING, "table"))

# (what, file, fault, the error it must draw: a pattern)
PLANTED = [
    ("an unknown dashboard field", T, _set("refreshInterval", "10s"), r"^\$\.refreshInterval: unknown field"),
    # (schemaVersion may be left out: @grafana/schema's defaultDashboard supplies it)
    ("a required field missing", T, _set("annotations.list.0.name", _DELETE), r"list\[0\]\.name: missing"),
    ("an unknown panel field", T, _set(f"panels.{_STAT}.colour", "red"), r"\.colour: unknown field"),
    ("a panel kind no type covers", T, _set(f"panels.{_STAT}.type", "piechart"), r"\.type: \"piechart\" is not one of"),
    ("a misspelt panel option", T, _set(f"panels.{_TS}.options.legend.showLegned", True),
     r"options\.legend\.showLegned: unknown field"),
    ("an enum value the panel lacks", T, _set(f"panels.{_STAT}.options.colorMode", "values"),
     r"options\.colorMode: \"values\" is not one of"),
    ("a custom field option of another panel kind", T,
     _set(f"panels.{_STAT}.fieldConfig.defaults.custom", {"lineWidth": 1}), r"custom\.lineWidth: unknown field"),
    ("a misspelt override property", T,
     _set(f"panels.{_TABLE}.fieldConfig.overrides.0.properties.0.id", "custom.widht"),
     r"properties\[0\]\.id: \"custom\.widht\" is not one of"),
    ("an unknown matcher", T, _set(f"panels.{_TABLE}.fieldConfig.overrides.0.matcher.id", "byTitle"),
     r"matcher\.id: \"byTitle\" is not one of"),
    ("a misspelt transformation option", T, _set(f"panels.{_TABLE}.transformations.1.options.renameByNames", {}),
     r"options\.renameByNames: unknown field"),
    ("a Prometheus target field past the allowlist", T, _set(f"panels.{_STAT}.targets.0.intervalFactor", 2),
     r"targets\[0\]\.intervalFactor: unknown field"),
    ("a wrong value type", T, _set(f"panels.{_STAT}.gridPos.w", "4"), r"gridPos\.w: \"4\" is not a number"),
    ("an unknown variable field", T, _set("templating.list.0.refreshOn", 2), r"list\[0\]\.refreshOn: unknown field"),
    ("an unknown data source key", "datasources", _set("datasources.0.isDefualt", True),
     r"datasources\[0\]\.isDefualt: unknown field"),
    ("a misspelt jsonData key", "datasources", _set("datasources.0.jsonData.timeInterva", "15s"),
     r"jsonData\.timeInterva: unknown field"),
    ("a misspelt Tempo key", "datasources", _set("datasources.1.jsonData.tracesToMetrics.spanStartTimeshift", "-5m"),
     r"tracesToMetrics\.spanStartTimeshift: unknown field"),
    ("a misspelt provider option", "dashboards", _set("providers.0.options.foldersFromFileStructure", False),
     r"options\.foldersFromFileStructure: unknown field"),
]


def _shipped() -> dict:
    """name -> (types file, type, value) for every shipped file."""
    out = {name: ("dashboard.ts", "CheckedDashboard", dash) for name, dash in DASHBOARDS.items()}
    for name, (path, type_name) in PROVISIONING.items():
        out[name] = ("provisioning.ts", type_name, yaml.safe_load(path.read_text()))
    return out


@pytest.fixture(scope="module")
def checked():
    """The checker's answer: {"shipped": {name: errors}, "planted": [errors], "versions",
    "schemaVersion"}."""
    grafana_npm.require_packages()
    shipped = _shipped()
    checks = [{"file": f, "type": t, "value": v} for f, t, v in shipped.values()]
    for _, name, fault, _ in PLANTED:
        file, type_name, value = shipped[name]
        value = copy.deepcopy(value)
        fault(value)
        checks.append({"file": file, "type": type_name, "value": value})
    out = grafana_npm.run_node("schema.cjs", {"files": FILES, "checks": checks})
    return {"shipped": dict(zip(shipped, out["errors"][:len(shipped)], strict=True)),
            "planted": out["errors"][len(shipped):], "versions": out["versions"],
            "schemaVersion": out["schemaVersion"]}


def _titled(name: str, message: str) -> str:
    """A panel path with the panel's title: ``$.panels[7] "Throughput"...``."""
    dash = DASHBOARDS.get(name)
    match = re.match(r"\$\.panels\[(\d+)\](?:\.panels\[(\d+)\])?", message)
    if not dash or not match:
        return message
    panel = dash["panels"][int(match.group(1))]
    if match.group(2):
        panel = panel["panels"][int(match.group(2))]
    return f'{match.group(0)} "{panel.get("title")}"{message[match.end():]}'


def test_the_checker_reads_the_pinned_packages(checked):
    assert checked["versions"] == grafana_npm.PINNED


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_matches_grafanas_types(checked, name):
    errors = [_titled(name, e) for e in checked["shipped"][name]]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", sorted(PROVISIONING))
def test_provisioning_file_has_only_documented_keys(checked, name):
    errors = checked["shipped"][name]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("index", range(len(PLANTED)), ids=[p[0] for p in PLANTED])
def test_a_planted_fault_is_refused(checked, index):
    """A copy of a shipped file with one fault draws exactly the one error for it."""
    _, name, _, pattern = PLANTED[index]
    errors = checked["planted"][index]
    assert len(errors) == 1 and re.search(pattern, errors[0]), (name, errors)


def test_dashboards_are_no_newer_than_grafanas_schema(checked):
    """Grafana migrates an older schemaVersion on load; a newer one it does not know."""
    for name, dash in DASHBOARDS.items():
        assert dash["schemaVersion"] <= checked["schemaVersion"], (name, dash["schemaVersion"])
