"""prom_translate: OTLP protos -> OpenMetrics named as Prometheus 3 (UnderscoreEscapingWithSuffixes)."""

from __future__ import annotations

import re

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2 as m

from tests.stack.prom_translate import (COUNTER, GAUGE, HISTOGRAM, Translator, label_name,
                                        metric_name, promoted_attributes)
from tests.stack.promserver import ROOT

NAMES = [  # (OTel name, unit, kind, Prometheus 3 name)
    ("training.step.duration", "s", HISTOGRAM, "training_step_duration_seconds"),
    ("training.steps", "{step}", COUNTER, "training_steps_total"),
    ("training.gpu.idle", "s", COUNTER, "training_gpu_idle_seconds_total"),
    ("system.cpu.utilization", "1", GAUGE, "system_cpu_utilization_ratio"),
    ("system.network.throughput", "By/s", GAUGE, "system_network_throughput_bytes_per_second"),
    ("system.disk.operation_rate", "{operation}/s", GAUGE, "system_disk_operation_rate_per_second"),
    ("hw.gpu.temperature", "Cel", GAUGE, "hw_gpu_temperature_celsius"),
    ("hw.gpu.clock.sm", "Hz", GAUGE, "hw_gpu_clock_sm_hertz"),
    ("hw.gpu.clock.sm", "MHz", GAUGE, "hw_gpu_clock_sm_MHz"),  # no unit word: kept as written
    ("requests.total", "1", COUNTER, "requests_total"),         # no doubled _total
    ("cpu.utilization.ratio", "1", GAUGE, "cpu_utilization_ratio"),
    ("2xx.count", "", COUNTER, "_2xx_count_total"),
]


@pytest.mark.parametrize("otel, unit, kind, prom", NAMES)
def test_metric_names(otel, unit, kind, prom):
    assert metric_name(otel, unit, kind) == prom


def _contract_rows():
    text = (ROOT / "docs" / "telemetry.md").read_text()
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`") or "." not in cells[0]:
            continue
        names = [c for c in cells if re.fullmatch(r"`[a-z_]+`( \(.*\))?", c)]
        units = [c for c in cells[1:3] if c.startswith("`")]
        if not names or not units:
            continue
        instrument = cells[1] if not cells[1].startswith("`") else "gauge"
        kind = {"Histogram": HISTOGRAM, "Counter": COUNTER}.get(instrument, GAUGE)
        rows.append((cells[0].strip("`"), units[0].strip("`"), kind, names[-1].split("`")[1]))
    return rows


CONTRACT = _contract_rows()


@pytest.mark.parametrize("otel, unit, kind, prom", CONTRACT, ids=[r[0] for r in CONTRACT])
def test_contract_prometheus_names_are_the_translation(otel, unit, kind, prom):
    assert metric_name(otel, unit, kind) == prom


def test_contract_table_was_read():
    assert len(CONTRACT) >= 25


def test_label_names():
    assert label_name("host.name") == "host_name"
    assert label_name("training.phase.parent") == "training_phase_parent"
    assert label_name("0day") == "key_0day"
    assert label_name("_private") == "key_private"


def test_promoted_attributes_from_prometheus_yml():
    assert "training.run.id" in promoted_attributes(str(ROOT / "prometheus" / "prometheus.yml"))


# --- whole requests ------------------------------------------------------------------------

def _kv(key, value):
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def _request(metrics, resource=None):
    resource = resource or {"service.name": "train", "service.instance.id": "p0",
                            "training.run.id": "run-1", "host.name": "node-1",
                            "telemetry.sdk.language": "python"}
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.extend(_kv(k, v) for k, v in resource.items())
    rm.scope_metrics.add().metrics.extend(metrics)
    return req


T = 1_700_000_000_000_000_000  # ns


def _histogram():
    metric = m.Metric(name="training.step.duration", unit="s", description="Step")
    metric.histogram.aggregation_temporality = m.AGGREGATION_TEMPORALITY_CUMULATIVE
    p = metric.histogram.data_points.add(time_unix_nano=T, count=5, sum=1.5,
                                         explicit_bounds=[0.1, 0.5, 1.0], bucket_counts=[1, 2, 2, 0])
    p.attributes.extend([_kv("host.name", "node-1"), _kv("training.mode", "train"), _kv("training.rank", 1)])
    ex = p.exemplars.add(time_unix_nano=T - 1_000_000, as_double=0.42,
                         trace_id=bytes.fromhex("0af7651916cd43dd8448eb211c80319c"),
                         span_id=bytes.fromhex("b7ad6b7169203331"))
    assert ex
    return metric


def _counter(temporality=m.AGGREGATION_TEMPORALITY_CUMULATIVE):
    metric = m.Metric(name="training.steps", unit="{step}")
    metric.sum.is_monotonic = True
    metric.sum.aggregation_temporality = temporality
    metric.sum.data_points.add(time_unix_nano=T, as_int=7).attributes.extend(
        [_kv("host.name", "from-point")])
    return metric


def test_histogram_counter_and_target_info():
    tr = Translator(["training.run.id", "host.name"])
    tr.add(_request([_histogram(), _counter()]))
    text = tr.openmetrics()
    assert "# TYPE training_step_duration_seconds histogram" in text
    base = 'host_name="node-1",instance="p0",job="train"'
    assert (f'training_step_duration_seconds_bucket{{{base},le="0.5",training_mode="train",'
            f'training_rank="1",training_run_id="run-1"}} 3 1700000000.000 '
            '# {span_id="b7ad6b7169203331",trace_id="0af7651916cd43dd8448eb211c80319c"} 0.42 1699999999.999') in text
    assert f'training_step_duration_seconds_bucket{{{base},le="+Inf",' in text
    assert f'training_step_duration_seconds_count{{{base},training_mode="train",training_rank="1",training_run_id="run-1"}} 5 ' in text
    assert "training_step_duration_seconds_sum{" in text and "} 1.5 1700000000.000" in text
    # counters get _total; a data point's own attribute wins over a promoted resource one
    assert 'training_steps_total{host_name="from-point",instance="p0",job="train",training_run_id="run-1"} 7 ' in text
    assert ('target_info{host_name="node-1",instance="p0",job="train",telemetry_sdk_language="python",'
            'training_run_id="run-1"} 1 1700000000.000') in text
    assert text.endswith("# EOF\n")


def test_delta_counters_are_dropped_like_prometheus_does():
    tr = Translator()
    tr.add(_request([_counter(m.AGGREGATION_TEMPORALITY_DELTA)]))
    assert "training.steps" in tr.dropped and "training_steps_total" not in tr.openmetrics()


def test_namespace_joins_job_and_gauge_ratio():
    metric = m.Metric(name="hw.gpu.utilization", unit="1")
    metric.gauge.data_points.add(time_unix_nano=T, as_double=0.25)
    tr = Translator()
    tr.add(_request([metric], {"service.name": "train", "service.namespace": "ml", "service.instance.id": "p"}))
    text = tr.openmetrics(timestamps=False)
    assert 'hw_gpu_utilization_ratio{instance="p",job="ml/train"} 0.25\n' in text
    assert "target_info" not in text  # only identifying resource attributes
