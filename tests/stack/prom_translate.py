"""OTLP metric protos -> OpenMetrics text, named as Prometheus 3's OTLP receiver names them.

Mirrors the ``UnderscoreEscapingWithSuffixes`` translation of Prometheus 3.5
(github.com/prometheus/otlptranslator): name tokens joined by ``_``, the unit as a
word (``s`` -> ``seconds``, ``By/s`` -> ``bytes_per_second``, units in braces
dropped, an unmapped unit kept as written), ``_total`` on monotonic sums, ``_ratio``
on gauges of unit ``1``; histograms as ``_bucket{le}``/``_sum``/``_count`` with
exemplars on buckets; ``service.name`` -> ``job`` (prefixed by
``service.namespace/``), ``service.instance.id`` -> ``instance``, the
``promote_resource_attributes`` of prometheus.yml as labels (a data point's own
attribute wins), and ``target_info`` with every other resource attribute.

The text carries timestamps (seconds) so ``promtool tsdb create-blocks-from
openmetrics`` can load it; a scrape target can serve it without (``timestamps=False``).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

UNIT_MAP = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
    "us": "microseconds", "ns": "nanoseconds",
    "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes",
    "TiBy": "tibibytes", "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes",
    "TBy": "terabytes",
    "m": "meters", "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams",
    "Cel": "celsius", "Hz": "hertz", "1": "", "%": "percent",
}
PER_UNIT_MAP = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week",
                "mo": "month", "y": "year"}
IDENTIFYING = ("service.name", "service.namespace", "service.instance.id")

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
_NON_NAME = re.compile(r"[^a-zA-Z0-9:]")
_NON_LABEL = re.compile(r"[^a-zA-Z0-9_]")


def _clean_unit(unit: str) -> str:
    return re.sub(r"__+", "_", _NON_NAME.sub("_", unit)).lstrip("_")


def metric_name(name: str, unit: str, kind: str) -> str:
    """The Prometheus name of an OTLP metric; ``kind``: gauge, counter (monotonic sum) or histogram."""
    tokens = [t for t in _NON_NAME.split(name) if t]
    parts = unit.split("/", 1)
    main = per = ""
    if parts[0].strip() and not any(c in parts[0] for c in "{}"):
        main = UNIT_MAP.get(parts[0].strip(), parts[0].strip())
    if len(parts) > 1 and parts[1].strip() and not any(c in parts[1] for c in "{}"):
        per = "per_" + PER_UNIT_MAP.get(parts[1].strip(), parts[1].strip())
    main, per = _clean_unit(main), _clean_unit(per)
    if main in tokens:
        main = ""
    per = "" if per == "per_" else per.rstrip("_")
    if per in tokens:
        per = ""
    if per:
        main = main.rstrip("_")
    tokens += [t for t in (main, per) if t]
    if kind == COUNTER:
        tokens = [t for t in tokens if t != "total"] + ["total"]
    if unit == "1" and kind == GAUGE:
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    out = "_".join(tokens)
    return "_" + out if out[:1].isdigit() else out


def label_name(key: str) -> str:
    """An attribute key as a Prometheus label name (``host.name`` -> ``host_name``)."""
    out = _NON_LABEL.sub("_", key)
    if out[:1].isdigit():
        return "key_" + out
    if out.startswith("_") and not out.startswith("__"):
        return "key" + out
    return out


def _value(any_value) -> str:
    kind = any_value.WhichOneof("value")
    if kind is None:
        return ""
    v = getattr(any_value, kind)
    if kind == "bool_value":
        return "true" if v else "false"
    if kind == "double_value":
        return _num(v)
    if kind == "array_value":
        return "[" + ",".join(_value(x) for x in v.values) + "]"
    return str(v)


def _num(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(float(v))


def _labels(attributes, extra: Dict[str, str]) -> Dict[str, str]:
    """Data-point attributes as labels; colliding names join their values with ``;``."""
    by_label: Dict[str, List[Tuple[str, str]]] = defaultdict(list)
    for kv in attributes:
        by_label[label_name(kv.key)].append((kv.key, _value(kv.value)))
    out = {name: ";".join(v for _, v in sorted(vals)) for name, vals in by_label.items()}
    for name, value in extra.items():
        out.setdefault(name, value)
    return out


@dataclass
class Family:
    """One metric family: its samples per label set (sorted items), by timestamp in ms."""

    name: str
    kind: str
    help: str = ""
    samples: Dict[Tuple, Dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    exemplars: Dict[Tuple, Dict[int, Tuple]] = field(default_factory=lambda: defaultdict(dict))


class Translator:
    """Accumulates ExportMetricsServiceRequest protos; ``openmetrics()`` writes them out."""

    def __init__(self, promote: Sequence[str] = ()) -> None:
        self.promote = list(promote)
        self.families: Dict[str, Family] = {}
        self.dropped: List[str] = []

    def _family(self, name: str, kind: str, help_text: str) -> Family:
        fam = self.families.get(name)
        if fam is None:
            fam = self.families[name] = Family(name, kind, help_text)
        return fam

    def add(self, request) -> None:
        for rm in request.resource_metrics:
            res = {kv.key: _value(kv.value) for kv in rm.resource.attributes}
            extra: Dict[str, str] = {}
            if "service.name" in res:
                ns = res.get("service.namespace")
                extra["job"] = f"{ns}/{res['service.name']}" if ns else res["service.name"]
            if "service.instance.id" in res:
                extra["instance"] = res["service.instance.id"]
            for key in self.promote:
                if key in res and key not in IDENTIFYING:
                    extra.setdefault(label_name(key), res[key])
            times = []
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    times += self._metric(metric, extra)
            self._target_info(rm.resource.attributes, extra, times)

    def _target_info(self, attributes, extra, times) -> None:
        attrs = [kv for kv in attributes if kv.key not in IDENTIFYING]
        if not attrs or not times or not ({"job", "instance"} & set(extra)):
            return
        ids = {k: v for k, v in extra.items() if k in ("job", "instance")}
        key = ("target_info",) + tuple(sorted(_labels(attrs, ids).items()))
        fam = self._family("target_info", GAUGE, "Target metadata")
        for t in set(times):
            fam.samples[key][t] = 1.0

    def _metric(self, metric, extra) -> List[int]:
        data = metric.WhichOneof("data")
        times: List[int] = []
        if data == "gauge" or (data == "sum" and not metric.sum.is_monotonic):
            points, kind = getattr(metric, data).data_points, GAUGE
        elif data == "sum":
            if metric.sum.aggregation_temporality != 2:  # only cumulative counters
                self.dropped.append(metric.name)
                return times
            points, kind = metric.sum.data_points, COUNTER
        elif data == "histogram":
            if metric.histogram.aggregation_temporality != 2:
                self.dropped.append(metric.name)
                return times
            return self._histogram(metric, extra)
        else:  # exponential histograms and summaries: not emitted by otel-training
            self.dropped.append(metric.name)
            return times
        name = metric_name(metric.name, metric.unit, kind)
        fam = self._family(name, kind, metric.description)
        sample = name + "_total" if kind == COUNTER and not name.endswith("_total") else name
        for p in points:
            if p.flags & 1:  # no recorded value: a staleness marker in Prometheus
                continue
            t = p.time_unix_nano // 1_000_000
            value = p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int)
            labels = _labels(p.attributes, extra)
            fam.samples[(sample,) + tuple(sorted(labels.items()))][t] = value
            times.append(t)
        return times

    def _histogram(self, metric, extra) -> List[int]:
        name = metric_name(metric.name, metric.unit, HISTOGRAM)
        fam = self._family(name, HISTOGRAM, metric.description)
        times = []
        for p in metric.histogram.data_points:
            if p.flags & 1:
                continue
            t = p.time_unix_nano // 1_000_000
            times.append(t)
            labels = tuple(sorted(_labels(p.attributes, extra).items()))
            bounds = list(p.explicit_bounds) + [math.inf]
            cumulative = 0
            for i, bound in enumerate(bounds):
                cumulative += p.bucket_counts[i] if i < len(p.bucket_counts) else 0
                le = "+Inf" if math.isinf(bound) else _num(bound)
                key = (name + "_bucket",) + tuple(sorted(labels + (("le", le),)))
                fam.samples[key][t] = float(cumulative if not math.isinf(bound) else p.count)
            fam.samples[(name + "_count",) + labels][t] = float(p.count)
            if p.HasField("sum"):
                fam.samples[(name + "_sum",) + labels][t] = p.sum
            for ex in p.exemplars:
                value = ex.as_double if ex.WhichOneof("value") == "as_double" else float(ex.as_int)
                bound = next(b for b in bounds if value <= b)
                le = "+Inf" if math.isinf(bound) else _num(bound)
                key = (name + "_bucket",) + tuple(sorted(labels + (("le", le),)))
                ex_labels = {}
                if ex.trace_id:
                    ex_labels["trace_id"] = ex.trace_id.hex()
                if ex.span_id:
                    ex_labels["span_id"] = ex.span_id.hex()
                fam.exemplars[key][t] = (ex_labels, value, ex.time_unix_nano // 1_000_000)
        return times

    def series_names(self) -> set:
        """Every sample name (``__name__``) written."""
        return {key[0] for fam in self.families.values() for key in fam.samples}

    def openmetrics(self, timestamps: bool = True, shift_ms: int = 0) -> str:
        """The OpenMetrics exposition; with ``timestamps=False`` only each series' last value."""
        lines: List[str] = []
        for fam in sorted(self.families.values(), key=lambda f: f.name):
            lines.append(f"# TYPE {fam.name} {fam.kind}")
            if fam.help:
                lines.append(f"# HELP {fam.name} {_escape_help(fam.help)}")
            for key in _ordered(fam):
                points = fam.samples[key]
                stamps = sorted(points) if timestamps else [max(points)]
                for t in stamps:
                    line = f"{key[0]}{_fmt_labels(key[1:])} {_num(points[t])}"
                    if timestamps:
                        line += f" {(t + shift_ms) / 1000:.3f}"
                    seen = fam.exemplars.get(key, {})
                    ex = seen.get(t) if timestamps else (seen[max(seen)] if seen else None)
                    if ex is not None:
                        ex_labels, value, ex_t = ex
                        line += f" # {_fmt_labels(tuple(sorted(ex_labels.items())))} {_num(value)}"
                        line += f" {(ex_t + shift_ms) / 1000:.3f}"
                    lines.append(line)
        lines.append("# EOF")
        return "\n".join(lines) + "\n"

    def time_range_ms(self) -> Tuple[int, int]:
        stamps = [t for fam in self.families.values() for pts in fam.samples.values() for t in pts]
        return (min(stamps), max(stamps)) if stamps else (0, 0)


def _ordered(fam: Family) -> List[Tuple]:
    """Series of a family; a histogram's buckets, count and sum kept together per label set."""
    def sort_key(key):
        labels = tuple(kv for kv in key[1:] if kv[0] != "le")
        le = dict(key[1:]).get("le")
        suffix_rank = {"_bucket": 0, "_count": 1, "_sum": 2}
        rank = next((r for s, r in suffix_rank.items() if key[0].endswith(s)), 0)
        return (labels, rank, float(le) if le is not None else 0.0)
    if fam.kind != HISTOGRAM:
        return sorted(fam.samples)
    return sorted(fam.samples, key=sort_key)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _fmt_labels(items: Iterable[Tuple[str, str]]) -> str:
    items = list(items)
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def promoted_attributes(prometheus_yml: str) -> List[str]:
    """``otlp.promote_resource_attributes`` of a prometheus.yml file."""
    import yaml

    with open(prometheus_yml, encoding="utf-8") as fh:
        config = yaml.safe_load(fh) or {}
    return list((config.get("otlp") or {}).get("promote_resource_attributes") or [])


def translate(requests: Iterable, promote: Sequence[str] = (),
              translator: Optional[Translator] = None) -> Translator:
    """Feed every request to a Translator and return it."""
    tr = translator or Translator(promote)
    for request in requests:
        tr.add(request)
    return tr
