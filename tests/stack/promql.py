"""Reading the stack's PromQL: every query of the dashboards and rules, Grafana variable
substitution, and the vector selectors (metric name + matchers) inside an expression.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
RULE_FILES = sorted((ROOT / "prometheus" / "rules").glob("*.yml"))

# The stack's own components, scraped by Prometheus (not training telemetry): `up` for
# every scrape job, and the Collector's internal metrics (service.telemetry, :8888;
# names of Collector 0.165.0, counters with `_total` in the Prometheus exposition).
STACK_COMPONENT_METRICS = {
    "up",
    "otelcol_receiver_refused_metric_points_total", "otelcol_receiver_refused_spans_total",
    "otelcol_exporter_send_failed_metric_points_total", "otelcol_exporter_send_failed_spans_total",
}

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "and", "or", "unless", "atan2", "inf", "nan", "start", "end"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_SELECTOR = re.compile(r"(?<![\w:.$\"])([a-zA-Z_:][\w:]*)?\s*(\{[^}]*\})?")


def dashboards() -> Dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in DASHBOARDS}


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, rows' nested panels included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_queries(dashboard: dict) -> Iterator[Tuple[dict, dict]]:
    """(panel, target) for every PromQL target."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield panel, target


def repeat_variable(dashboard: dict, panel: dict) -> str:
    """The variable Grafana repeats ``panel`` for (one copy per selected value): its own
    ``repeat``, or that of the row it sits in; "" when it is not repeated."""
    if panel.get("repeat"):
        return panel["repeat"]
    row = None
    for p in dashboard.get("panels", []):
        if p["type"] == "row":
            row = p
            if panel in p.get("panels", []):
                return p.get("repeat", "")
        elif p is panel:
            return (row or {}).get("repeat", "")
    return ""


def rules() -> Iterator[dict]:
    """Every recording and alerting rule of prometheus/rules."""
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            yield from group["rules"]


def variables(dashboard: dict) -> List[dict]:
    return dashboard.get("templating", {}).get("list", [])


def variable_query(var: dict) -> str:
    query = var.get("query")
    return query.get("query", "") if isinstance(query, dict) else (query or "")


def label_values_call(query: str) -> Tuple[str, str]:
    """``label_values(selector, label)`` -> (selector, label)."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query)
    if not match:
        raise ValueError(f"not a label_values() query: {query}")
    return match.group(1), match.group(2)


ALL = ".*"  # the dashboards' allValue: what Grafana inserts for "All"


def substitute(expr: str, values: Dict[str, str], rate_interval: str = "1m") -> str:
    """Grafana's interpolation for a Prometheus query: ``$var`` regex-escaped (the
    dashboards only use ``=~``), ``$__rate_interval``/``$__interval``/``$__range``."""
    for name in ("__rate_interval", "__interval", "__range"):
        expr = expr.replace("${" + name + "}", rate_interval).replace("$" + name, rate_interval)
    for name in sorted(values, key=len, reverse=True):
        # "All" is the variables' allValue, inserted as the regex it is; a value is escaped
        value = ALL if values[name] == ALL else re.escape(values[name]).replace("\\", "\\\\")
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return expr


def used_variables(text: str) -> set:
    return set(re.findall(r"\$\{?(\w+)", text)) - {"__rate_interval", "__interval", "__range"}


def selectors(expr: str) -> List[str]:
    """The vector selectors of a PromQL expression: ``name{matchers}`` or ``{matchers}``."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', lambda m: m.group(0).replace("(", "\x00").replace(")", "\x01"), expr)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)                      # range and subquery windows
    text = re.sub(r"\boffset\s+-?\d+\w*", " ", text)
    out = []
    for match in _SELECTOR.finditer(text):
        name, braces = match.group(1), match.group(2)
        if not name and not braces:
            continue
        if name and (name.lower() in KEYWORDS or re.fullmatch(r"\d.*", name)):
            continue
        rest = text[match.end():].lstrip()
        if name and not braces and rest.startswith("("):
            continue  # a function or aggregation call
        sel = (name or "") + (braces or "")
        out.append(sel.replace("\x00", "(").replace("\x01", ")"))
    return out


def with_matcher(selector: str, matcher: str) -> str:
    """Add a matcher (``job="x"``) to a selector."""
    if "{" in selector:
        head, body = selector.split("{", 1)
        body = body.rstrip("}").strip()
        return f"{head}{{{body + ', ' if body else ''}{matcher}}}"
    return f"{selector}{{{matcher}}}"


def metric_name(selector: str) -> str:
    name = selector.split("{", 1)[0].strip()
    if name:
        return name
    match = re.search(r'__name__\s*=\s*"([^"]+)"', selector)
    return match.group(1) if match else ""
