"""``otel-training stack up / status / down``: the compose file's services as local
processes. The plan is read from the compose file (no binaries needed); up, status and
down run the real binaries and leave nothing behind, also when ``up`` fails."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import yaml

from otel_training.cli import stack_plan
from tests.stack.realstack import Stack, cli, free_ports

pytestmark = pytest.mark.slow


@pytest.fixture
def stack_dir(tmp_path):
    directory = tmp_path / "s"
    assert cli("stack", "init", str(directory)).returncode == 0
    return directory


def _listening(port) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", int(port))) == 0


def _by_name(plan):
    return {s.name: s for s in plan.services}


# --- the plan, from the compose file -------------------------------------------------------

def test_the_plan_runs_the_compose_commands_on_loopback_ports(stack_dir):
    ports = free_ports()
    plan = stack_plan.plan(stack_dir, ports)
    services = _by_name(plan)
    assert set(services) == {"otel-collector", "prometheus", "alertmanager", "tempo"}
    prom = services["prometheus"]
    data = stack_dir.resolve() / "data" / "prometheus-data"
    assert f"--storage.tsdb.path={data}" in prom.args  # the named volume, under DIR
    assert f"--web.external-url=http://127.0.0.1:{ports['PROMETHEUS_PORT']}" in prom.args
    assert "--web.enable-otlp-receiver" in prom.args and "--enable-feature=exemplar-storage" in prom.args
    assert prom.args[-1] == f"--web.listen-address=127.0.0.1:{ports['PROMETHEUS_PORT']}"
    assert prom.health == f"http://127.0.0.1:{ports['PROMETHEUS_PORT']}/-/ready"
    assert prom.wait_s == 10 + 10 * 12  # the compose healthcheck: start period + interval x retries
    collector = services["otel-collector"]
    assert collector.args == (f"--config={stack_dir.resolve()}/collector-config/config.yaml",)
    assert collector.after == ("prometheus", "tempo")
    assert collector.env["PROMETHEUS_OTLP_ENDPOINT"] == f"http://127.0.0.1:{ports['PROMETHEUS_PORT']}/api/v1/otlp"
    assert collector.env["TEMPO_OTLP_ENDPOINT"] == f"127.0.0.1:{ports['TEMPO_OTLP_GRPC_PORT']}"
    assert services["tempo"].program == "jaeger" and "Jaeger" in services["tempo"].note
    assert {s.name for s in plan.skipped} == {"grafana", "grafana-init", "tempo-init"}


def test_the_derived_configs_name_loopback_ports_instead_of_compose_names(stack_dir):
    ports = free_ports()
    plan = stack_plan.plan(stack_dir, ports)
    derived = {p.name: v for p, v in plan.derived.items()}
    prom = yaml.safe_load(derived["prometheus.yml"])
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in prom["scrape_configs"]}
    assert targets == {
        "prometheus": [f"127.0.0.1:{ports['PROMETHEUS_PORT']}"],
        "otel-collector": [f"127.0.0.1:{ports['COLLECTOR_METRICS_PORT']}"],
        "tempo": [f"127.0.0.1:{ports['TEMPO_METRICS_PORT']}"],  # Jaeger's own /metrics
        "alertmanager": [f"127.0.0.1:{ports['ALERTMANAGER_PORT']}"],
    }
    assert prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        f"127.0.0.1:{ports['ALERTMANAGER_PORT']}"]
    assert all(Path(p).is_absolute() for p in prom["rule_files"])
    # everything else is the shipped file's
    shipped = yaml.safe_load((stack_dir / "prometheus" / "prometheus.yml").read_text())
    assert prom["otlp"] == shipped["otlp"] and prom["storage"] == shipped["storage"]
    am = yaml.safe_load(derived["alertmanager.yml"])
    urls = [h["url"] for r in am["receivers"] for h in r.get("webhook_configs", [])]
    assert urls and all(u.startswith("http://127.0.0.1:9099/") for u in urls)


@pytest.mark.parametrize("value", ["abc", "0", "70000"])
def test_a_malformed_port_variable_is_named_with_the_accepted_values(stack_dir, value):
    with pytest.raises(stack_plan.PlanError, match=rf"PROMETHEUS_PORT='{value}': a port number from 1 to 65535"):
        stack_plan.plan(stack_dir, {"PROMETHEUS_PORT": value})
    proc = cli("stack", "up", str(stack_dir), env={**os.environ, "PROMETHEUS_PORT": value})
    assert proc.returncode == 1 and "PROMETHEUS_PORT" in proc.stderr and "Traceback" not in proc.stderr


def test_up_without_binaries_says_where_they_come_from(stack_dir, tmp_path):
    empty = tmp_path / "no-bin"
    empty.mkdir()
    proc = cli("stack", "up", str(stack_dir), "--bin-dir", str(empty), env={**os.environ, **free_ports()})
    assert proc.returncode == 1
    assert "scripts/install-stack.sh" in proc.stderr and "Without Docker" in proc.stderr
    assert not (stack_dir / ".stack").exists() or not list((stack_dir / ".stack").glob("*.pid"))


# --- up, status, down with the real binaries ------------------------------------------------

def test_up_status_down_and_nothing_left_listening(stack_bin, tmp_path):
    stack = Stack(tmp_path / "fresh", stack_bin)  # no `stack init`: up writes the files first
    try:
        out = stack.up().stdout
        assert "wrote" in out and "grafana: not run without Docker" in out
        assert f"OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:{stack.ports['OTLP_GRPC_PORT']}" in out
        report = stack.status()["services"]
        states = {k: v["state"] for k, v in report.items()}
        assert states == {"prometheus": "healthy", "alertmanager": "healthy", "tempo": "healthy",
                          "otel-collector": "healthy", "grafana-init": "not started",
                          "grafana": "not started", "tempo-init": "not started"}
        for name in ("prometheus", "alertmanager", "tempo", "otel-collector"):
            log = Path(report[name]["log"])
            assert log.parent == (tmp_path / "fresh" / "logs").resolve() and log.stat().st_size > 0
        assert (tmp_path / "fresh" / "data" / "prometheus-data").is_dir()
        again = stack.up().stdout  # idempotent: running services are left alone
        assert again.count("already running") == 4
        text = cli("stack", "status", str(stack.directory), env=stack.env)
        assert text.returncode == 0 and "healthy" in text.stdout and "not started" in text.stdout
    finally:
        proc = stack.down()
    assert proc.returncode == 0 and "4 services stopped" in proc.stdout
    listening = [v for k, v in stack.ports.items() if k != "GRAFANA_PORT" and _listening(v)]
    assert not listening
    assert cli("stack", "status", str(stack.directory), env=stack.env).returncode == 1  # all stopped


def test_a_failed_up_leaves_nothing_running(stack_bin, stack_dir):
    config = stack_dir / "collector-config" / "config.yaml"
    config.write_text(config.read_text().replace("memory_limiter:\n    check_interval: 1s",
                                                 "memory_limiter:\n    check_intervall: 1s", 1))
    stack = Stack(stack_dir, stack_bin)
    proc = cli("stack", "up", str(stack_dir), "--bin-dir", str(stack_bin), env=stack.env)
    assert proc.returncode == 1
    assert "otel-collector exited at start" in proc.stderr and "check_intervall" in proc.stderr
    time.sleep(0.5)
    assert not [v for v in stack.ports.values() if _listening(v)]
    assert not list((stack_dir / ".stack").glob("*.pid"))
    report = json.loads(cli("stack", "status", str(stack_dir), "--json", env=stack.env).stdout)
    assert {v["state"] for k, v in report["services"].items() if v["url"]} == {"stopped"}


def test_a_taken_port_is_named_and_nothing_starts(stack_bin, stack_dir):
    stack = Stack(stack_dir, stack_bin)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(stack.ports["ALERTMANAGER_PORT"])))
        taken.listen()
        proc = cli("stack", "up", str(stack_dir), "--bin-dir", str(stack_bin), env=stack.env)
    assert proc.returncode == 1 and f"port {stack.ports['ALERTMANAGER_PORT']}" in proc.stderr
    assert not [v for k, v in stack.ports.items() if k != "ALERTMANAGER_PORT" and _listening(v)]


def test_up_finds_what_install_stack_built_without_bin_dir(stack_bin, tmp_path, monkeypatch):
    """PATH first, then the cache's bin/ that scripts/install-stack.sh links into."""
    from otel_training.cli import stack_procs

    built = tmp_path / "cache" / "stack" / "bin"
    built.mkdir(parents=True)
    for name in ("otelcol", "prometheus", "alertmanager", "jaeger"):
        (built / name).symlink_to(stack_bin / name)
    monkeypatch.setenv("OTEL_TRAINING_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    found = stack_procs.find_binaries(None, {"otelcol", "prometheus", "alertmanager", "jaeger"})
    assert found == {name: str(built / name) for name in found} and len(found) == 4
    monkeypatch.setenv("OTEL_TRAINING_CACHE_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(stack_procs.StackError, match="no alertmanager, jaeger, otelcol, prometheus on PATH or in"):
        stack_procs.find_binaries(None, {"otelcol", "prometheus", "alertmanager", "jaeger"})
