"""The distro only sets defaults: what the user set wins."""

from otel_training.distro import apply_defaults


def test_defaults_are_set_and_user_values_win():
    env = {"OTEL_METRIC_EXPORT_INTERVAL": "1000", "OTEL_RESOURCE_ATTRIBUTES": "team=vision"}
    apply_defaults(env)
    assert env["OTEL_METRIC_EXPORT_INTERVAL"] == "1000"
    assert env["OTEL_TRACES_EXPORTER"] == env["OTEL_METRICS_EXPORTER"] == "otlp"
    assert env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] == "system_metrics"
    attrs = dict(kv.split("=", 1) for kv in env["OTEL_RESOURCE_ATTRIBUTES"].split(","))
    assert attrs["team"] == "vision"
    assert attrs["service.instance.id"] and attrs["training.run.id"] and attrs["host.name"]


def test_system_metrics_can_be_turned_back_on():
    env = {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": ""}
    apply_defaults(env)
    assert env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] == ""
