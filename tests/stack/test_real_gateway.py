"""Multi-node: a per-node agent (collector-config/agent.yaml) forwards to the central
gateway (collector-config/gateway.yaml) over TLS with a bearer token, both as shipped,
run by the Collector that scripts/install-stack.sh built; the gateway exports into the
real stack's Prometheus and trace store. Data sent through the agent arrives once; an
agent with a wrong token is refused and nothing of its data is stored."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.stack.promserver import free_port
from tests.stack.realstack import Stack, cli, wait_for

pytestmark = pytest.mark.slow

TOKEN = "s3cret-token-of-the-test"


def _certificates(directory: Path) -> dict:
    """A CA and a gateway certificate for localhost / 127.0.0.1, made with openssl."""
    def run(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=otel-training test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "gateway.key", "-out", "gateway.csr",
        "-subj", "/CN=localhost")
    (directory / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "gateway.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "gateway.pem", "-days", "2", "-extfile", "san.ext")
    return {"ca": directory / "ca.pem", "cert": directory / "gateway.pem", "key": directory / "gateway.key"}


class Collector:
    """One otelcol process on a shipped config, with its variables."""

    def __init__(self, binary: Path, config: Path, env: dict, log: Path) -> None:
        self.health = int(env["COLLECTOR_HEALTH_PORT"])
        self.log = log
        with open(log, "w") as fh:
            self.proc = subprocess.Popen([str(binary), f"--config={config}"], env={**os.environ, **env},
                                         stdout=fh, stderr=subprocess.STDOUT)
        import urllib.request

        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health}/", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                return False
        assert wait_for(ready, 30, 0.2), log.read_text()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _send(endpoint: str, service: str) -> None:
    """One counter point and one span over OTLP/gRPC, from the SDK, flushed."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    resource = Resource.create({"service.name": service, "training.run.id": f"{service}-run"})
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, insecure=True),
                                           export_interval_millis=60_000)
    meters = MeterProvider(resource=resource, metric_readers=[reader])
    meters.get_meter("gateway-test").create_counter("gateway.probe", unit="{probe}").add(7)
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    with tracer_provider.get_tracer("gateway-test").start_as_current_span("probe"):
        pass
    meters.shutdown()  # one export
    tracer_provider.shutdown()


@pytest.fixture(scope="module")
def gateway(stack_bin, tmp_path_factory):
    work = tmp_path_factory.mktemp("gateway")
    stack = Stack(work / "s", stack_bin)
    assert cli("stack", "init", str(stack.directory)).returncode == 0
    stack.up()
    certs = _certificates(work)
    (work / "token").write_text(TOKEN + "\n")
    (work / "wrong-token").write_text("not-the-token\n")
    for f in ("token", "wrong-token"):
        os.chmod(work / f, 0o600)
    configs = stack.directory / "collector-config"
    gw_port = free_port()
    collectors = []
    try:
        collectors.append(Collector(stack_bin / "otelcol", configs / "gateway.yaml", {
            "OTEL_GATEWAY_CERT_FILE": str(certs["cert"]), "OTEL_GATEWAY_KEY_FILE": str(certs["key"]),
            "OTEL_GATEWAY_TOKEN_FILE": str(work / "token"), "COLLECTOR_LISTEN_HOST": "127.0.0.1",
            "OTLP_GRPC_PORT": str(gw_port), "COLLECTOR_HEALTH_PORT": str(free_port()),
            "COLLECTOR_METRICS_PORT": str(free_port()),
            "TEMPO_OTLP_ENDPOINT": f"127.0.0.1:{stack.ports['TEMPO_OTLP_GRPC_PORT']}",
            "PROMETHEUS_OTLP_ENDPOINT": f"{stack.prometheus.url}/api/v1/otlp",
        }, work / "gateway.log"))
        agents = {}
        for name, token in (("good", "token"), ("bad", "wrong-token")):
            grpc = free_port()
            collectors.append(Collector(stack_bin / "otelcol", configs / "agent.yaml", {
                "OTEL_GATEWAY_ENDPOINT": f"localhost:{gw_port}", "OTEL_GATEWAY_CA_FILE": str(certs["ca"]),
                "OTEL_GATEWAY_TOKEN_FILE": str(work / token), "OTLP_GRPC_PORT": str(grpc),
                "OTLP_HTTP_PORT": str(free_port()), "COLLECTOR_HEALTH_PORT": str(free_port()),
                "COLLECTOR_METRICS_PORT": str(free_port()),
            }, work / f"agent-{name}.log"))
            agents[name] = f"http://127.0.0.1:{grpc}"
        yield stack, agents, work
    finally:
        for c in reversed(collectors):
            c.stop()
        stack.down()


def test_data_through_the_agent_and_gateway_arrives_once(gateway):
    stack, agents, _ = gateway
    _send(agents["good"], "gw-good")
    series = wait_for(lambda: stack.prometheus.query('gateway_probe_total{job="gw-good"}'), 30)
    assert len(series) == 1 and float(series[0]["value"][1]) == 7.0
    assert series[0]["metric"]["training_run_id"] == "gw-good-run"  # promoted as by a direct export
    samples = stack.prometheus.query('count_over_time(gateway_probe_total{job="gw-good"}[1h])')
    assert float(samples[0]["value"][1]) == 1.0  # one sample: not duplicated on the way
    traces = wait_for(lambda: stack.jaeger.find("gw-good", {}), 30)
    assert [s["operationName"] for t in traces for s in t["spans"]] == ["probe"]


def test_an_agent_with_a_wrong_token_is_refused_and_nothing_is_stored(gateway):
    stack, agents, work = gateway
    _send(agents["bad"], "gw-bad")
    log = work / "agent-bad.log"
    refused = wait_for(lambda: "Unauthenticated" in log.read_text() or "Unauthenticated" in
                       (work / "gateway.log").read_text(), 30)
    assert refused, log.read_text()[-3000:]
    _send(agents["good"], "gw-after")  # a later good export gets through: the bad one had its chance
    assert wait_for(lambda: stack.prometheus.query('gateway_probe_total{job="gw-after"}'), 30)
    time.sleep(1)
    assert not stack.prometheus.query('{job="gw-bad"}')
    assert "gw-bad" not in stack.jaeger.services()
