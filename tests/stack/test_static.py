"""Static checks of the stack's files: compose, Collector configs, Grafana provisioning and
dashboards, rules' annotations and runbooks. No binaries needed."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.stack import promql as q
from tests.stack.prom_translate import metric_name
from tests.stack.promserver import ROOT

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
VERSIONS = dict(line.split("=", 1) for line in (ROOT / "scripts" / "stack" / "versions.env").read_text().splitlines()
                if line and not line.startswith("#"))
COLLECTOR_VERSION = VERSIONS["OTELCOL_VERSION"]
# Component types of the Collector release built from scripts/stack/otelcol-builder.yaml
# (and of the contrib image of that release) that our configs use (0.144.0 renamed the
# OTLP exporters to otlp_grpc / otlp_http).
COMPONENTS = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "batch"},
    "exporters": {"otlp_grpc", "otlp_http"},
    "extensions": {"health_check", "bearertokenauth"},
}
# The Builder manifest's modules and the component type each provides.
MODULE_TYPES = {
    "otlpreceiver": "otlp", "batchprocessor": "batch", "memorylimiterprocessor": "memory_limiter",
    "otlpexporter": "otlp_grpc", "otlphttpexporter": "otlp_http",
    "healthcheckextension": "health_check", "bearertokenauthextension": "bearertokenauth",
}
PANEL_TYPES = {"row", "timeseries", "stat", "bargauge", "barchart", "heatmap", "table", "alertlist"}
PROM_UID, TEMPO_UID = "otel-training-prometheus", "otel-training-tempo"


def _collector(name: str) -> dict:
    """A Collector config as the container sees it: no variable with a default is set
    there, so each ``${env:NAME:-default}`` is its default (the compose names)."""
    text = (ROOT / "collector-config" / name).read_text()
    return yaml.safe_load(re.sub(r"\$\{env:\w+:-([^}]*)\}", r"\1", text))


def _manifest_modules() -> dict:
    """Kind -> module names of scripts/stack/otelcol-builder.yaml."""
    manifest = yaml.safe_load((ROOT / "scripts" / "stack" / "otelcol-builder.yaml").read_text())
    return {kind: {entry["gomod"].split()[0].rsplit("/", 1)[1] for entry in manifest[kind]}
            for kind in ("receivers", "processors", "exporters", "extensions")}


def _datasources() -> list:
    path = ROOT / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
    return yaml.safe_load(path.read_text())["datasources"]


# --- docker-compose.yml ----------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(COMPOSE["services"]))
def test_images_are_pinned(name):
    image = COMPOSE["services"][name]["image"]
    repo, _, tag = image.rpartition(":")
    assert repo and tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), image


def test_expected_images_and_versions():
    images = {s["image"].rpartition(":")[0]: s["image"].rpartition(":")[2]
              for s in COMPOSE["services"].values()}
    assert images["otel/opentelemetry-collector-contrib"] == COLLECTOR_VERSION
    assert images["prom/prometheus"].startswith("v3.")
    # the images are the versions scripts/install-stack.sh builds (bump both together)
    assert images["otel/opentelemetry-collector-contrib"] == VERSIONS["OTELCOL_VERSION"]
    assert images["prom/prometheus"] == "v" + VERSIONS["PROMETHEUS_VERSION"]
    assert VERSIONS["OTELCOL_CONTRIB_VERSION"] == VERSIONS["OTELCOL_VERSION"]
    assert images["grafana/tempo"].startswith("2.")
    # 2.10.6 carries security fixes over 2.10.0-2.10.5
    assert tuple(int(x) for x in images["grafana/tempo"].split(".")) >= (2, 10, 6), images["grafana/tempo"]
    assert "grafana/grafana" in images
    assert images["prom/alertmanager"].startswith("v0.")


@pytest.mark.parametrize("name", sorted(COMPOSE["services"]))
def test_ports_bound_to_loopback(name):
    for port in COMPOSE["services"][name].get("ports", []):
        assert str(port).startswith("127.0.0.1:"), f"{name}: {port}"


@pytest.mark.parametrize("name", sorted(COMPOSE["services"]))
def test_config_mounted_read_only(name):
    for volume in COMPOSE["services"][name].get("volumes", []):
        if volume.startswith("./"):
            assert volume.endswith(":ro"), f"{name}: {volume}"
            assert (ROOT / volume.split(":")[0]).exists(), volume


def test_grafana_credentials_and_access():
    env = COMPOSE["services"]["grafana"]["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:-}"
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    # Grafana starts only once grafana-init has passed (see the next tests).
    deps = COMPOSE["services"]["grafana"]["depends_on"]
    assert deps["grafana-init"]["condition"] == "service_completed_successfully"


_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)((?::?[-?+])[^}]*)?\}")


def _interpolate(text: str, env: dict) -> str:
    """Compose's variable interpolation (``$$`` escapes ``$``); raises like compose does
    for ``${VAR:?message}`` / ``${VAR?message}`` when VAR is unset (or empty, with ``:``)."""
    def one(match):
        name, op = match.group(1), match.group(2) or ""
        value = env.get(name)
        if op.startswith(":-"):
            return value if value else op[2:]
        if op.startswith("-"):
            return value if value is not None else op[1:]
        if op.startswith(":?") or op.startswith("?"):
            if (value is None) or (op.startswith(":") and not value):
                raise ValueError(f"required variable {name} is missing a value: {op.lstrip(':?')}")
            return value
        if value is None:
            return ""
        return value
    return _INTERPOLATION.sub(one, text.replace("$$", "\x00")).replace("\x00", "$")


def _render(env: dict):
    """docker-compose.yml as compose sees it: parsed, then every string interpolated."""
    def walk(node):
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return _interpolate(node, env) if isinstance(node, str) else node
    return walk(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def test_compose_needs_no_variable_for_ps_logs_down():
    """Compose interpolates the whole file for every command (ps, logs, down too): with
    no variable set at all, nothing may be required."""
    with pytest.raises(ValueError):  # (the check can fail: a required variable would)
        _interpolate("${GRAFANA_ADMIN_PASSWORD:?set it}", {})
    rendered = _render({})
    grafana = rendered["services"]["grafana"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == ""
    assert "127.0.0.1:3000:3000" in grafana["ports"]


def _grafana_init(tmp_path, password, database_exists):
    """Run grafana-init's check with a real shell, as compose would (``$$`` -> ``$``)."""
    import subprocess

    service = COMPOSE["services"]["grafana-init"]
    entry = [_interpolate(part, {}) for part in service["entrypoint"]]
    db = tmp_path / "grafana.db"
    if database_exists:
        db.write_text("")
    env = {"PATH": "/usr/bin:/bin", "GRAFANA_DB": str(db)}
    if password is not None:
        env["GRAFANA_ADMIN_PASSWORD"] = password
    return subprocess.run(entry, env=env, capture_output=True, text=True, timeout=30)


def test_first_up_refuses_to_start_grafana_without_a_password(tmp_path):
    service = COMPOSE["services"]["grafana-init"]
    assert service["image"] == COMPOSE["services"]["grafana"]["image"]
    assert "grafana-data:/var/lib/grafana" in service["volumes"]
    assert service["environment"]["GRAFANA_DB"] == "/var/lib/grafana/grafana.db"
    refused = _grafana_init(tmp_path, None, database_exists=False)
    assert refused.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in refused.stderr
    assert _grafana_init(tmp_path, "", database_exists=False).returncode != 0
    assert _grafana_init(tmp_path, "s3cret", database_exists=False).returncode == 0
    # later `up`s: the password lives in Grafana's database already
    assert _grafana_init(tmp_path, None, database_exists=True).returncode == 0


PORT_VARIABLES = {"GRAFANA_PORT": 3000, "PROMETHEUS_PORT": 9090, "ALERTMANAGER_PORT": 9093,
                  "TEMPO_PORT": 3200, "OTLP_GRPC_PORT": 4317, "OTLP_HTTP_PORT": 4318,
                  "COLLECTOR_HEALTH_PORT": 13133}


def test_each_host_port_has_its_variable():
    seen = {}
    for name, service in COMPOSE["services"].items():
        for port in service.get("ports", []):
            match = re.fullmatch(r"127\.0\.0\.1:\$\{(\w+):-(\d+)\}:(\d+)", str(port))
            assert match, f"{name}: {port}"
            seen[match.group(1)] = int(match.group(2))
    assert seen == PORT_VARIABLES
    stack_doc = (ROOT / "docs" / "stack.md").read_text()
    for variable in PORT_VARIABLES:
        assert f"`{variable}`" in stack_doc, variable
    # the rendered ports with other values: one variable moves one port
    moved = _render({"GRAFANA_PORT": "3300", "OTLP_GRPC_PORT": "14317"})
    assert "127.0.0.1:3300:3000" in moved["services"]["grafana"]["ports"]
    assert "127.0.0.1:14317:4317" in moved["services"]["otel-collector"]["ports"]
    assert "127.0.0.1:9090:9090" in moved["services"]["prometheus"]["ports"]


def test_prometheus_serves_the_runbooks_at_its_external_url():
    prom = COMPOSE["services"]["prometheus"]
    assert "--web.external-url=http://127.0.0.1:${PROMETHEUS_PORT:-9090}" in prom["command"]
    assert "--web.user-assets=/usr/share/prometheus/user" in prom["command"]
    assert "./docs/runbooks.md:/usr/share/prometheus/user/runbooks.md:ro" in prom["volumes"]


# --- Tempo ------------------------------------------------------------------------------

def test_tempo_metrics_generator_can_run_and_nothing_promises_a_service_graph():
    tempo = yaml.safe_load((ROOT / "tempo" / "tempo.yaml").read_text())
    generator = tempo["metrics_generator"]
    # Without storage.path Tempo disables the metrics-generator entirely (TraceQL metrics fail).
    assert generator["storage"]["path"].startswith("/var/tempo/")
    assert generator["traces_storage"]["path"].startswith("/var/tempo/")
    processors = tempo["overrides"]["defaults"]["metrics_generator"]["processors"]
    assert "local-blocks" in processors
    assert "tempo-data:/var/tempo" in COMPOSE["services"]["tempo"]["volumes"]
    # A service graph needs the service-graphs processor writing to Prometheus.
    ds = next(d for d in _datasources() if d["type"] == "tempo")["jsonData"]
    if "serviceMap" in ds:
        assert "service-graphs" in processors and generator["storage"].get("remote_write")
    else:
        assert "service-graphs" not in processors and not ds.get("nodeGraph", {}).get("enabled")


def test_prometheus_flags_and_healthchecks():
    prom = COMPOSE["services"]["prometheus"]
    assert "--web.enable-otlp-receiver" in prom["command"]
    assert "--enable-feature=exemplar-storage" in prom["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    for name in ("prometheus", "grafana"):
        assert COMPOSE["services"][name]["healthcheck"]["test"][0] == "CMD"
    assert COMPOSE["services"]["otel-collector"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_tempo_volume_is_handed_to_its_user():
    init, tempo = COMPOSE["services"]["tempo-init"], COMPOSE["services"]["tempo"]
    assert init["command"][:3] == ["chown", "-R", "10001:10001"]
    assert tempo["depends_on"]["tempo-init"]["condition"] == "service_completed_successfully"
    assert "tempo-data:/var/tempo" in init["volumes"] and "tempo-data:/var/tempo" in tempo["volumes"]
    assert tempo["user"] == "10001:10001"


def test_mounted_files_match_commands():
    col = COMPOSE["services"]["otel-collector"]
    assert "--config=/etc/otelcol-contrib/config.yaml" in col["command"]
    assert "./collector-config/config.yaml:/etc/otelcol-contrib/config.yaml:ro" in col["volumes"]
    tempo = COMPOSE["services"]["tempo"]
    assert "-config.file=/etc/tempo/tempo.yaml" in tempo["command"]
    provider = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/dashboards.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert f"./grafana/dashboards:{path}:ro" in COMPOSE["services"]["grafana"]["volumes"]


# --- Collector configs -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["config.yaml", "agent.yaml", "gateway.yaml"])
def test_collector_pipelines_use_defined_components(name):
    cfg = _collector(name)
    service = cfg["service"]
    for kind in ("receivers", "processors", "exporters", "extensions"):
        for comp in cfg.get(kind, {}):
            assert comp.split("/")[0] in COMPONENTS[kind], f"{kind}: {comp} unknown in {COLLECTOR_VERSION}"
    for ext in service.get("extensions", []):
        assert ext in cfg["extensions"]
    used = {"receivers": set(), "processors": set(), "exporters": set()}
    for pipeline, spec in service["pipelines"].items():
        assert spec["processors"][0] == "memory_limiter", pipeline
        assert "batch" in spec["processors"], pipeline
        for kind in used:
            for comp in spec.get(kind, []):
                assert comp in cfg[kind], f"{pipeline}: {comp} is not defined"
                used[kind].add(comp)
    for kind in used:  # nothing defined and left unused
        assert used[kind] == set(cfg.get(kind, {})), kind
    assert "health_check" in service["extensions"]


def test_the_builder_manifest_lists_exactly_the_components_the_configs_use():
    used = {kind: set() for kind in COMPONENTS}
    for name in ("config.yaml", "agent.yaml", "gateway.yaml"):
        cfg = _collector(name)
        for kind in used:
            used[kind] |= {comp.split("/")[0] for comp in cfg.get(kind, {})}
    built = {kind: {MODULE_TYPES[m] for m in modules} for kind, modules in _manifest_modules().items()}
    assert built == used
    manifest = (ROOT / "scripts" / "stack" / "otelcol-builder.yaml").read_text()
    versions = set(re.findall(r"v\$\{(\w+)\}", manifest))
    assert versions == {"OTELCOL_VERSION", "OTELCOL_CONTRIB_VERSION", "OTELCOL_PROVIDERS_VERSION"}


def test_collector_addresses_default_to_the_compose_names():
    """Every address in the stack's Collector configs is a variable whose default is what
    the compose network needs, so `stack up` can run the same file on 127.0.0.1."""
    text = (ROOT / "collector-config" / "config.yaml").read_text()
    assert not re.search(r"(?<![-{])\b(0\.0\.0\.0|tempo|prometheus):\d", re.sub(r"\$\{env:\w+:-[^}]*\}", "", text))
    for name in ("COLLECTOR_LISTEN_HOST", "OTLP_GRPC_PORT", "OTLP_HTTP_PORT", "COLLECTOR_HEALTH_PORT",
                 "COLLECTOR_METRICS_PORT", "TEMPO_OTLP_ENDPOINT", "PROMETHEUS_OTLP_ENDPOINT"):
        assert "${env:" + name + ":-" in text, name


def test_stack_collector_exports_to_tempo_and_prometheus():
    cfg = _collector("config.yaml")
    assert cfg["exporters"]["otlp_http/prometheus"]["endpoint"] == "http://prometheus:9090/api/v1/otlp"
    assert cfg["exporters"]["otlp_grpc/tempo"]["endpoint"] == "tempo:4317"
    assert cfg["service"]["pipelines"]["traces"]["exporters"] == ["otlp_grpc/tempo"]
    assert cfg["service"]["pipelines"]["metrics"]["exporters"] == ["otlp_http/prometheus"]
    protocols = cfg["receivers"]["otlp"]["protocols"]
    assert set(protocols) == {"grpc", "http"}


@pytest.mark.parametrize("name", ["config.yaml", "gateway.yaml"])
def test_collector_metrics_are_where_prometheus_scrapes_them(name):
    """The stack's Collector (or the gateway in its place) serves its own metrics on
    :8888 of its container for Prometheus's otel-collector job: the Telemetry* alerts."""
    (reader,) = _collector(name)["service"]["telemetry"]["metrics"]["readers"]
    exporter = reader["pull"]["exporter"]["prometheus"]
    assert (exporter["host"], exporter["port"]) == ("0.0.0.0", 8888)
    prom = yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "otel-collector")
    assert job["static_configs"][0]["targets"] == ["otel-collector:8888"]


def test_agent_and_gateway_use_tls_and_a_bearer_token():
    agent, gateway = _collector("agent.yaml"), _collector("gateway.yaml")
    exporter = agent["exporters"]["otlp_grpc/gateway"]
    assert exporter["auth"]["authenticator"] in agent["service"]["extensions"]
    assert exporter["tls"]["ca_file"] and not exporter["tls"].get("insecure")
    grpc = gateway["receivers"]["otlp"]["protocols"]["grpc"]
    assert grpc["tls"]["cert_file"] and grpc["tls"]["key_file"]
    assert grpc["auth"]["authenticator"] in gateway["service"]["extensions"]
    assert agent["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].startswith("127.0.0.1:")


# --- Grafana -----------------------------------------------------------------------------

def test_datasources_have_fixed_uids_and_cross_links():
    by_uid = {d["uid"]: d for d in _datasources()}
    assert set(by_uid) == {PROM_UID, TEMPO_UID}
    dest = by_uid[PROM_UID]["jsonData"]["exemplarTraceIdDestinations"]
    assert [(d["name"], d["datasourceUid"]) for d in dest] == [("trace_id", TEMPO_UID)]
    t2m = by_uid[TEMPO_UID]["jsonData"]["tracesToMetrics"]
    assert t2m["datasourceUid"] == PROM_UID
    assert {"key": "training.run.id", "value": "training_run_id"} in t2m["tags"]
    for query in t2m["queries"]:
        assert "$$__tags" in query["query"]  # "$$": escaped from Grafana's env expansion


@pytest.mark.parametrize("name", sorted(q.dashboards()))
def test_dashboard_structure(name):
    dash = q.dashboards()[name]
    assert dash["uid"] == f"otel-training-{name}" and dash["id"] is None
    ids = [p["id"] for p in q.panels(dash)]
    assert len(ids) == len(set(ids))
    defined = {v["name"] for v in q.variables(dash)}
    used = set()
    for panel in q.panels(dash):
        assert panel["type"] in PANEL_TYPES, f"{panel['title']}: {panel['type']}"
        if panel["type"] in ("row", "alertlist"):
            continue
        assert panel["datasource"]["uid"] == PROM_UID
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == PROM_UID
            used |= q.used_variables(target["expr"])
    for var in q.variables(dash):
        assert var["datasource"]["uid"] == PROM_UID
        q.label_values_call(q.variable_query(var))
        used |= q.used_variables(q.variable_query(var))
    assert used <= defined, used - defined
    assert defined <= used | {"training_rank"}, defined - used


def test_dashboard_variables():
    names = {n: [v["name"] for v in q.variables(d)] for n, d in q.dashboards().items()}
    assert names["training"] == ["job", "training_run_id", "host_name", "training_rank"]
    assert names["hardware"] == ["job", "training_run_id", "host_name", "gpu_index"]
    for dash in q.dashboards().values():
        for var in q.variables(dash):
            assert var["includeAll"] and var["allValue"] == ".*"


def test_training_dashboard_panels():
    dash = q.dashboards()["training"]
    by_type = {}
    for panel in q.panels(dash):
        by_type.setdefault(panel["type"], []).append(panel)
    assert {"timeseries", "stat", "bargauge", "heatmap", "table", "alertlist"} <= set(by_type)
    (heatmap,) = by_type["heatmap"]
    (target,) = heatmap["targets"]
    assert target["exemplar"] and target["format"] == "heatmap"
    assert "training_step_duration_seconds_bucket" in target["expr"]
    exprs = " ".join(t["expr"] for _, t in q.panel_queries(dash))
    assert 'training_phase_parent="step"' in exprs
    for needle in ("training_samples", "training_steps", 'training_phase="untracked"',
                   'training_phase="dataloader_next"', "training_gpu_idle", "training_rank",
                   # throughput, FLOPs/MFU and memory per step
                   "training_tokens", "training_flops", "training_mfu_ratio",
                   "training_memory_peak_allocated_bytes", "training_memory_peak_reserved_bytes",
                   "training_memory_allocated_bytes", "training_memory_rss_bytes",
                   "training_memory_alloc_retries_total", "training_memory_ooms_total",
                   # the wall time by activity, goodput
                   "training_job_time_seconds_total", "training_activity", "training_goodput_ratio"):
        assert needle in exprs, needle
    (alerts,) = by_type["alertlist"]
    assert alerts["options"]["stateFilter"]["firing"]


def _hardware_gauges() -> dict:
    from otel_training.hardware.names import GAUGES

    return {name: metric_name(name, unit, "gauge") for name, (unit, _) in GAUGES.items()}


def test_hardware_dashboard_shows_every_hardware_gauge():
    pytest.importorskip("otel_training.hardware.names")
    exprs = " ".join(t["expr"] for _, t in q.panel_queries(q.dashboards()["hardware"]))
    missing = [prom for prom in _hardware_gauges().values() if prom not in exprs]
    assert not missing


# --- names: only the contract's (plus recording rules and target_info) ---------------------

def _contract_names() -> set:
    text = (ROOT / "docs" / "telemetry.md").read_text()
    names = set()
    for cell in re.findall(r"\|\s*`([a-z_]+)`(?: \(`_bucket`, `_sum`, `_count`\))?\s*\|", text):
        names.add(cell)
    for base in [n for n in names if n.endswith("_seconds") or n.endswith("duration")]:
        names |= {base + s for s in ("_bucket", "_sum", "_count")}
    return names


def test_dashboards_and_rules_use_only_contract_names():
    recorded = {r["record"] for r in q.rules() if "record" in r}
    allowed = _contract_names() | recorded | {"target_info"} | q.STACK_COMPONENT_METRICS
    exprs = [t["expr"] for d in q.dashboards().values() for _, t in q.panel_queries(d)]
    exprs += [r["expr"] for r in q.rules()]
    exprs += [q.label_values_call(q.variable_query(v))[0]
              for d in q.dashboards().values() for v in q.variables(d)]
    for expr in exprs:
        for sel in q.selectors(expr):
            assert q.metric_name(sel) in allowed, f"{q.metric_name(sel)} in {expr}"


# --- rules' annotations and runbooks ----------------------------------------------------------

ALERTS = [r for r in q.rules() if "alert" in r]


@pytest.mark.parametrize("rule", ALERTS, ids=[r["alert"] for r in ALERTS])
def test_alert_annotations_and_runbook(rule):
    assert rule["labels"]["severity"] in ("critical", "warning", "info")
    ann = rule["annotations"]
    assert ann["summary"].strip() and ann["description"].strip()
    # An absolute link: Prometheus's external URL, where it serves docs/runbooks.md
    # (--web.user-assets in docker-compose.yml; the delivery test follows the link).
    assert ann["runbook_url"] == "{{ $externalURL }}/user/runbooks.md#" + rule["alert"].lower()
    headings = re.findall(r"^## (\S+)", (ROOT / "docs" / "runbooks.md").read_text(), re.M)
    assert rule["alert"] in headings


@pytest.mark.parametrize("rule", ALERTS, ids=[r["alert"] for r in ALERTS])
def test_every_alert_has_firing_and_idle_unit_tests(rule):
    fires = silent_idle = False
    for path in sorted((ROOT / "prometheus" / "tests").glob("*.yml")):
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                if case["alertname"] != rule["alert"]:
                    continue
                fires |= bool(case.get("exp_alerts"))
                silent_idle |= not case.get("exp_alerts") and "idle" in test["name"]
    assert fires and silent_idle
