"""The compose file's services as local processes: what ``stack up`` starts, read from
``docker-compose.yml`` in the stack directory.

Each service keeps its compose command, with the container's paths mapped to the
stack directory (bind mounts to their files, named volumes to ``data/<volume>``) and
its listeners on 127.0.0.1 at the host ports the compose file publishes, from the same
variables and defaults. Ports the compose file does not publish get variables of their
own (``INTERNAL_PORTS``). Service names in the configurations are resolved as follows:
the Collector's configs take their endpoints from variables whose defaults are the
compose names; Prometheus' and Alertmanager's configs, which have no variables, are
written to ``.stack/`` with each ``service:port`` replaced by ``127.0.0.1:<host port>``.
Tempo's place is taken by Jaeger v2 (``tempo/jaeger.yaml``); Grafana is not started.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

COMPOSE = "docker-compose.yml"
STATE = ".stack"  # pid files and derived configs
LOGS = "logs"
DATA = "data"
HOST = "127.0.0.1"

# Ports a service listens on inside the compose network without publishing them:
# (service, container port) -> (variable, default host port).
INTERNAL_PORTS: dict[tuple[str, int], tuple[str, int]] = {
    ("otel-collector", 8888): ("COLLECTOR_METRICS_PORT", 8888),
    ("tempo", 4317): ("TEMPO_OTLP_GRPC_PORT", 4417),
    ("tempo", 4318): ("TEMPO_OTLP_HTTP_PORT", 4418),
    ("tempo", 8888): ("TEMPO_METRICS_PORT", 8889),
    ("tempo", 13133): ("TEMPO_HEALTH_PORT", 13134),
    ("tempo", 16685): ("TEMPO_QUERY_GRPC_PORT", 16685),
}
# Prometheus scrapes Tempo's /metrics on its API port; Jaeger serves its own elsewhere.
SCRAPE_PORTS = {("tempo", 3200): ("tempo", 8888)}


class PlanError(ValueError):
    """The stack directory cannot be run: the message says what to change."""


@dataclass(frozen=True)
class Service:
    """One compose service as a local process."""

    name: str
    program: str  # the binary's name in the bin directory
    args: tuple[str, ...]
    env: Mapping[str, str]
    url: str  # what a person opens (its API)
    health: str | None  # polled until it answers 2xx; None: listening on ``ports`` is enough
    wait_s: float  # the compose healthcheck's start period + interval x retries
    ports: tuple[int, ...]  # every host port it listens on
    after: tuple[str, ...] = ()  # services it waits for (depends_on)
    note: str = ""


@dataclass(frozen=True)
class Skipped:
    """A compose service ``stack up`` does not run, and why."""

    name: str
    why: str


@dataclass
class Plan:
    directory: Path
    services: list[Service] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    derived: dict[Path, str] = field(default_factory=dict)  # configs written at up
    otlp_endpoint: str = ""  # what a training job sets as OTEL_EXPORTER_OTLP_ENDPOINT (gRPC)


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: ``${VAR:-default}``, ``${VAR-default}``, ``$VAR``, ``$$``."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(3)
        value = env.get(name)
        if m.group(2) is not None and not value:
            return m.group(2)
        return value or ""

    return _VAR.sub(one, text)


def _port(env: Mapping[str, str], variable: str, default: int) -> int:
    raw = env.get(variable) or str(default)
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise PlanError(f"{variable}={raw!r}: a port number from 1 to 65535 (default {default})")
    return int(raw)


class _Ports:
    """Host ports of every (service, container port), published or internal."""

    def __init__(self, compose: dict[str, Any], env: Mapping[str, str]) -> None:
        self.by: dict[tuple[str, int], int] = {}
        for name, svc in compose["services"].items():
            for spec in svc.get("ports", []):
                # "127.0.0.1:${VAR:-4317}:4317": the variable gives the host port
                m = re.fullmatch(r"(?:[\d.]+:)?\$\{(\w+):-(\d+)\}:(\d+)", str(spec))
                if m:
                    self.by[(name, int(m.group(3)))] = _port(env, m.group(1), int(m.group(2)))
                else:
                    host, _, container = interpolate(str(spec), env).rpartition(":")
                    self.by[(name, int(container))] = int(host.rpartition(":")[2] or container)
        for key, (variable, default) in INTERNAL_PORTS.items():
            self.by[key] = _port(env, variable, default)

    def __call__(self, service: str, container_port: int) -> int:
        try:
            return self.by[(service, container_port)]
        except KeyError:
            raise PlanError(f"{COMPOSE}: nothing maps {service}:{container_port} to a host port") from None

    def of(self, service: str) -> tuple[int, ...]:
        return tuple(sorted(p for (s, _), p in self.by.items() if s == service))


def _mounts(directory: Path, svc: dict[str, Any]) -> list[tuple[str, Path]]:
    """(container path, local path), longest first: bind mounts and named volumes."""
    out = []
    for spec in svc.get("volumes", []):
        parts = str(spec).split(":")
        source, target = parts[0], parts[1]
        local = directory / source if source.startswith(".") else directory / DATA / source
        out.append((target, local.resolve()))
    return sorted(out, key=lambda m: -len(m[0]))


def _map_path(value: str, mounts: list[tuple[str, Path]]) -> str:
    for target, local in mounts:
        if value == target or value.startswith(target + "/"):
            return str(local) + value[len(target) :]
    return value


def _command(directory: Path, name: str, svc: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    mounts = _mounts(directory, svc)
    out = []
    for arg in svc.get("command", []):
        arg = interpolate(str(arg), env)
        flag, eq, value = arg.partition("=")
        out.append(f"{flag}={_map_path(value, mounts)}" if eq else _map_path(arg, mounts))
    return out


def _health(svc: dict[str, Any], ports: _Ports, name: str) -> tuple[str | None, float]:
    """The healthcheck's URL on the host, and how long compose would wait for it."""
    check = svc.get("healthcheck") or {}
    url = next((str(a) for a in check.get("test", []) if str(a).startswith("http")), None)
    if url:
        m = re.match(r"http://[^:/]+:(\d+)(.*)", url)
        if m:
            url = f"http://{HOST}:{ports(name, int(m.group(1)))}{m.group(2)}"

    def seconds(text: object, default: float) -> float:
        m = re.fullmatch(r"(\d+)s", str(text or ""))
        return float(m.group(1)) if m else default

    wait = seconds(check.get("start_period"), 10) + seconds(check.get("interval"), 10) * int(check.get("retries", 12))
    return url, wait


def _rewrite_targets(node: Any, ports: _Ports, scrape: bool) -> Any:
    """``service:port`` strings -> ``127.0.0.1:<host port>`` through a parsed config."""
    if isinstance(node, dict):
        return {k: _rewrite_targets(v, ports, scrape or k == "scrape_configs") for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite_targets(v, ports, scrape) for v in node]
    if isinstance(node, str):
        m = re.fullmatch(r"([a-z][a-z0-9-]*):(\d+)", node)
        if m:
            service, port = ("prometheus" if m.group(1) == "localhost" else m.group(1)), int(m.group(2))
            if scrape:
                service, port = SCRAPE_PORTS.get((service, port), (service, port))
            if (service, port) in ports.by:
                return f"{HOST}:{ports(service, port)}"
        return re.sub(r"//host\.docker\.internal:", f"//{HOST}:", node)
    return node


def _listening_on(
    port: int, name: str, args: list[str], svc: dict[str, Any], ports: _Ports, after: tuple[str, ...]
) -> Service:
    """A service whose binary takes ``--web.listen-address`` (Prometheus, Alertmanager)."""
    health, wait = _health(svc, ports, name)
    return Service(
        name,
        name,
        (*args, f"--web.listen-address={HOST}:{port}"),
        {},
        f"http://{HOST}:{port}",
        health,
        wait,
        ports.of(name),
        after,
    )


def _load(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"{path}: missing (otel-training stack init {path.parent} writes the stack)") from None
    except yaml.YAMLError as exc:
        raise PlanError(f"{path}: not valid YAML: {exc}".splitlines()[0]) from None


def plan(directory: Path, environ: Mapping[str, str] | None = None) -> Plan:
    """The services of ``directory``'s compose file as local processes."""
    env = dict(os.environ if environ is None else environ)
    directory = directory.resolve()
    compose = _load(directory / COMPOSE)
    if not isinstance(compose, dict) or not isinstance(compose.get("services"), dict):
        raise PlanError(f"{directory / COMPOSE}: no services")
    services: dict[str, Any] = compose["services"]
    for needed in ("otel-collector", "prometheus", "alertmanager", "tempo"):
        if needed not in services:
            raise PlanError(f"{directory / COMPOSE}: no '{needed}' service")
    ports = _Ports(compose, env)
    state = directory / STATE
    out = Plan(directory)

    def after(name: str) -> tuple[str, ...]:
        deps = services[name].get("depends_on") or {}
        return tuple(d for d in deps if d in ("otel-collector", "prometheus", "alertmanager", "tempo"))

    # Prometheus: its config with the compose names replaced, rule files made absolute.
    prom_svc = services["prometheus"]
    prom_args = _command(directory, "prometheus", prom_svc, env)
    prom_config = directory / "prometheus" / "prometheus.yml"
    config = _load(prom_config)
    config = _rewrite_targets(config, ports, scrape=False)
    config["rule_files"] = [str(prom_config.parent / p) for p in config.get("rule_files", [])]
    derived_prom = state / "prometheus.yml"
    out.derived[derived_prom] = yaml.safe_dump(config, sort_keys=False)
    user_assets = state / "prometheus-user"
    prom_args = [
        f"--config.file={derived_prom}"
        if a.startswith("--config.file=")
        else f"--web.user-assets={user_assets}"
        if a.startswith("--web.user-assets=")
        else a
        for a in prom_args
    ]
    out.derived[user_assets / "runbooks.md"] = (directory / "docs" / "runbooks.md").read_text(encoding="utf-8")
    prom_port = ports("prometheus", 9090)
    out.services.append(_listening_on(prom_port, "prometheus", prom_args, prom_svc, ports, after("prometheus")))

    # Alertmanager: its config with the webhook host of the compose network replaced.
    am_svc = services["alertmanager"]
    am_config = directory / "alertmanager" / "alertmanager.yml"
    derived_am = state / "alertmanager.yml"
    out.derived[derived_am] = yaml.safe_dump(_rewrite_targets(_load(am_config), ports, False), sort_keys=False)
    am_port = ports("alertmanager", 9093)
    am_args = [
        f"--config.file={derived_am}" if a.startswith("--config.file=") else a
        for a in _command(directory, "alertmanager", am_svc, env)
    ]
    out.services.append(_listening_on(am_port, "alertmanager", am_args, am_svc, ports, after("alertmanager")))

    # Tempo's place: Jaeger v2, receiving OTLP where the Collector sends traces.
    tempo_port = ports("tempo", 3200)
    jaeger_env = {
        "JAEGER_LISTEN_HOST": HOST,
        "TEMPO_PORT": str(tempo_port),
        "TEMPO_OTLP_GRPC_PORT": str(ports("tempo", 4317)),
        "TEMPO_OTLP_HTTP_PORT": str(ports("tempo", 4318)),
        "TEMPO_METRICS_PORT": str(ports("tempo", 8888)),
        "TEMPO_HEALTH_PORT": str(ports("tempo", 13133)),
        "TEMPO_QUERY_GRPC_PORT": str(ports("tempo", 16685)),
    }
    jaeger_config = directory / "tempo" / "jaeger.yaml"
    if not jaeger_config.is_file():
        raise PlanError(f"{jaeger_config}: missing (otel-training stack init {directory} writes it)")
    out.services.append(
        Service(
            "tempo",
            "jaeger",
            (f"--config={jaeger_config}",),
            jaeger_env,
            f"http://{HOST}:{tempo_port}",
            f"http://{HOST}:{ports('tempo', 13133)}/status",
            60.0,
            ports.of("tempo"),
            after("tempo"),
            note="Jaeger v2 in Tempo's place (Tempo is not run without Docker)",
        )
    )

    # The Collector last: its exporters need Prometheus healthy and the trace store up.
    col_svc = services["otel-collector"]
    # The one address a user may widen (OTLP from other nodes); the rest stay on loopback.
    listen = env.get("COLLECTOR_LISTEN_HOST") or HOST
    reach = HOST if listen in ("0.0.0.0", "::") else listen
    col_env = {
        "COLLECTOR_LISTEN_HOST": listen,
        "OTLP_GRPC_PORT": str(ports("otel-collector", 4317)),
        "OTLP_HTTP_PORT": str(ports("otel-collector", 4318)),
        "COLLECTOR_HEALTH_PORT": str(ports("otel-collector", 13133)),
        "COLLECTOR_METRICS_PORT": str(ports("otel-collector", 8888)),
        "TEMPO_OTLP_ENDPOINT": f"{HOST}:{ports('tempo', 4317)}",
        "PROMETHEUS_OTLP_ENDPOINT": f"http://{HOST}:{prom_port}/api/v1/otlp",
    }
    health_port = ports("otel-collector", 13133)
    out.otlp_endpoint = f"http://{reach}:{ports('otel-collector', 4317)}"
    out.services.append(
        Service(
            "otel-collector",
            "otelcol",
            tuple(_command(directory, "otel-collector", col_svc, env)),
            col_env,
            f"http://{reach}:{ports('otel-collector', 4318)}",
            f"http://{reach}:{health_port}/",
            60.0,
            ports.of("otel-collector"),
            after("otel-collector"),
        )
    )
    for name in services:
        if name.startswith("grafana"):
            out.skipped.append(Skipped(name, "not run without Docker (open grafana/dashboards/*.json in a Grafana)"))
        elif name == "tempo-init":
            out.skipped.append(Skipped(name, "not needed: the data directory is yours"))
        elif name not in {s.name for s in out.services}:
            out.skipped.append(Skipped(name, "not known to `stack up`"))
    return out
