"""The real stack for the end-to-end tests: ``otel-training stack up`` on a directory
written by ``stack init``, on free loopback ports, with the binaries that
``scripts/install-stack.sh`` built (the Collector from the Builder manifest, Prometheus
with its OTLP receiver, Jaeger in Tempo's place, Debian's Alertmanager).

The only changes to the shipped files are the ones a test must make (``for_test``):
1 s scrape and evaluation intervals, 1 s Alertmanager grouping waits, the webhooks on the
test's receiver, and ``for: 0s`` on the alerts a test makes fire.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

import yaml

from tests.stack.promserver import ROOT, Prometheus, free_port

BIN = ROOT / ".tools" / "bin"
STACK_BINARIES = ("otelcol", "prometheus", "promtool", "jaeger", "alertmanager")
# Every port variable `stack up` reads (docs/stack.md, "Without Docker").
PORT_VARIABLES = ("OTLP_GRPC_PORT", "OTLP_HTTP_PORT", "COLLECTOR_HEALTH_PORT", "COLLECTOR_METRICS_PORT",
                  "PROMETHEUS_PORT", "ALERTMANAGER_PORT", "TEMPO_PORT", "TEMPO_OTLP_GRPC_PORT",
                  "TEMPO_OTLP_HTTP_PORT", "TEMPO_METRICS_PORT", "TEMPO_HEALTH_PORT", "TEMPO_QUERY_GRPC_PORT",
                  "GRAFANA_PORT")


def cli(*args: str, env: Optional[dict] = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "otel_training.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def free_ports() -> Dict[str, str]:
    ports: Dict[str, str] = {}
    while len(ports) < len(PORT_VARIABLES):
        port = str(free_port())
        if port not in ports.values():
            ports[PORT_VARIABLES[len(ports)]] = port
    return ports


def for_test(directory: Path, webhook_url: str, fire_at_once: Iterable[str] = ()) -> None:
    """Edit the written stack as the tests must (see the module's docstring)."""
    prom_yml = directory / "prometheus" / "prometheus.yml"
    config = yaml.safe_load(prom_yml.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    prom_yml.write_text(yaml.safe_dump(config, sort_keys=False))
    fire = set(fire_at_once)
    for path in (directory / "prometheus" / "rules").glob("*.yml"):
        rules = yaml.safe_load(path.read_text())
        for group in rules["groups"]:
            for rule in group["rules"]:
                if rule.get("alert") in fire:
                    rule["for"] = "0s"
        path.write_text(yaml.safe_dump(rules, sort_keys=False))
    am_yml = directory / "alertmanager" / "alertmanager.yml"
    am = yaml.safe_load(am_yml.read_text())
    for receiver in am["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{webhook_url}/{receiver['name']}"
    for route in [am["route"], *am["route"].get("routes", [])]:
        for key in ("group_wait", "group_interval"):
            if key in route or route is am["route"]:
                route[key] = "1s"
    am_yml.write_text(yaml.safe_dump(am, sort_keys=False))


class RemotePrometheus(Prometheus):
    """The HTTP API of a Prometheus someone else started."""

    def __init__(self, url: str) -> None:  # noqa: D107 (no binaries, no process)
        self.url = url

    def series(self, match: str) -> List[dict]:
        return self.api("/api/v1/series", {"match[]": match, "start": f"{time.time() - 3600:.0f}"})

    def alerts(self) -> List[dict]:
        return self.api("/api/v1/alerts", {}, "GET")["alerts"]

    def metadata(self, metric: str) -> Dict[str, list]:
        return self.api("/api/v1/metadata", {"metric": metric}, "GET")

    def post_otlp(self, body: bytes) -> int:
        req = urllib.request.Request(self.url + "/api/v1/otlp/v1/metrics", data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status


class Jaeger:
    """Jaeger's HTTP query API (the one its UI uses)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, params: Optional[dict] = None) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=30) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return {"data": []}
            raise

    def trace(self, trace_id: str) -> List[dict]:
        """The trace's spans (``operationName``, ``spanID``, ``references``, ``tags``)."""
        data = self.get(f"/api/traces/{trace_id}").get("data") or []
        return [span for trace in data for span in trace["spans"]]

    def find(self, service: str, tags: dict, limit: int = 1000) -> List[dict]:
        return self.get("/api/traces", {"service": service, "tags": json.dumps(tags), "limit": limit,
                                        "lookback": "1h"}).get("data") or []

    def services(self) -> List[str]:
        return self.get("/api/services").get("data") or []


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.5):
    """Poll until ``predicate()`` is truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


class Stack:
    """``stack up`` on ``directory``; ``down()`` at the end (also when ``up`` failed)."""

    def __init__(self, directory: Path, bin_dir: Path = BIN, ports: Optional[Dict[str, str]] = None) -> None:
        self.directory = directory
        self.bin_dir = bin_dir
        self.ports = ports or free_ports()
        self.env = {**os.environ, **self.ports}
        self.prometheus = RemotePrometheus(f"http://127.0.0.1:{self.ports['PROMETHEUS_PORT']}")
        self.jaeger = Jaeger(f"http://127.0.0.1:{self.ports['TEMPO_PORT']}")
        self.otlp_grpc = f"http://127.0.0.1:{self.ports['OTLP_GRPC_PORT']}"
        self.alertmanager = f"http://127.0.0.1:{self.ports['ALERTMANAGER_PORT']}"

    def up(self) -> subprocess.CompletedProcess:
        proc = cli("stack", "up", str(self.directory), "--bin-dir", str(self.bin_dir), env=self.env)
        if proc.returncode != 0:
            raise RuntimeError(f"stack up failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def status(self) -> dict:
        proc = cli("stack", "status", str(self.directory), "--json", env=self.env)
        return json.loads(proc.stdout)

    def down(self) -> subprocess.CompletedProcess:
        return cli("stack", "down", str(self.directory), env=self.env)

    def log(self, service: str) -> str:
        path = self.directory / "logs" / f"{service}.log"
        return path.read_text(errors="replace") if path.exists() else ""
