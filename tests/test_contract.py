"""The contract (docs/telemetry.md) agrees with the code, the translation rules,
the dashboards and the rules."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from otel_training import semconv as sc
from otel_training.hardware import names as hw
from tests.stack.prom_translate import COUNTER, GAUGE, HISTOGRAM, metric_name

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "telemetry.md").read_text()
_KINDS = {"Histogram": HISTOGRAM, "Counter": COUNTER, "Gauge": GAUGE}


def _rows():
    """(otel name, instrument kind, unit, prometheus name) for every metric row."""
    rows = []
    header = None
    for line in DOC.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set(cells[0]) <= {"-", ":"} or "OTel name" not in header[0]:
            continue
        col = {h: i for i, h in enumerate(header)}
        otel = cells[0].strip("`")
        unit = cells[col["unit"]].strip("`")
        kind = _KINDS[cells[col["instrument"]]] if "instrument" in col else GAUGE
        prom = re.match(r"`([a-z_0-9]+)`", cells[col["Prometheus 3 name"]]).group(1)
        rows.append((otel, kind, unit, prom))
    return rows


ROWS = _rows()
PROM_NAMES = {prom for _, _, _, prom in ROWS}


def test_contract_has_the_tables():
    assert len(ROWS) >= 25


@pytest.mark.parametrize("otel,kind,unit,prom", ROWS, ids=[r[0] for r in ROWS])
def test_prometheus_names_follow_the_translation(otel, kind, unit, prom):
    assert metric_name(otel, unit, kind) == prom


def test_every_metric_in_code_is_documented():
    documented = {otel for otel, *_ in ROWS}
    code = {v for k, v in vars(sc).items() if k.startswith("METRIC_")}
    assert code <= documented
    units = {otel: unit for otel, _, unit, _ in ROWS}
    for name, (unit, _desc) in hw.GAUGES.items():
        assert units.get(name) == unit, name


def test_every_span_name_is_documented():
    for name in [sc.SPAN_STEP, sc.PHASE_DATALOADER_NEXT, sc.PHASE_TO_DEVICE, sc.PHASE_TRAIN_BATCH,
                 sc.PHASE_EVAL_BATCH, *sc.BATCH_CHILDREN, sc.PHASE_LR_SCHEDULERS, sc.PHASE_FROM_DEVICE,
                 sc.PHASE_REDUCE_METRICS, sc.PHASE_COMMUNICATION]:
        assert f"| `{name}` |" in DOC, name


def _referenced_metric_names(text: str) -> set:
    """Metric-looking identifiers in PromQL text: the families we export."""
    prefixes = ("training_", "system_", "hw_", "process_gpu_")
    names = set(re.findall(r"(?<![\w:])((?:%s)[a-z0-9_]*)(?![\w:])" % "|".join(prefixes), text))
    labels = ("_rank", "_mode", "_phase", "_parent", "_id", "_size", "_component", "_reason", "_direction",
              "_index", "_pid", "_name", "_model", "_type", "_activity")
    return {n for n in names if not n.endswith(labels)}


def _family(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in PROM_NAMES:
            return name[: -len(suffix)]
    return name


def _exprs():
    out = []
    for path in sorted((ROOT / "grafana").rglob("*.json")):
        out += [(path.name, m) for m in re.findall(r'"expr":\s*"((?:[^"\\]|\\.)*)"', path.read_text())]
    for path in sorted((ROOT / "prometheus" / "rules").glob("*.yml")):
        out.append((path.name, path.read_text()))
    return out


def test_dashboards_and_rules_use_only_contract_names():
    exprs = _exprs()
    assert exprs, "no dashboards or rules found"
    recorded = set()
    for path in (ROOT / "prometheus" / "rules").glob("*.yml"):
        recorded |= set(re.findall(r"record:\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", path.read_text()))
    unknown = set()
    for where, text in exprs:
        for name in _referenced_metric_names(text):
            if _family(name) not in PROM_NAMES and name not in recorded and not name.startswith("training_run"):
                unknown.add((where, name))
    assert not unknown, f"names not in docs/telemetry.md: {sorted(unknown)}"
