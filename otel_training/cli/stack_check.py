"""``otel-training stack check DIR``: validate a stack directory written by ``stack init``.

Every fault is one line, ``PATH: what is wrong``: a YAML or JSON file that does not
parse, a file the compose file mounts that is missing, a Collector pipeline or service
that names a receiver, processor, exporter, connector or extension its file does not
define, a dashboard uid that is missing
or used twice, a data source uid nothing provisions, a metric name that is not in the
telemetry contract (docs/telemetry.md, shipped as ``otel_training/telemetry.md``), and
what ``promtool`` / ``amtool`` / ``otelcol validate`` reject when they are on PATH. Checks that read a file
which did not parse are skipped, so one broken file gives one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

PROG = "otel-training stack check"
# Families otel-training exports; other names in a query (the stack's own) are not ours to check.
PREFIXES = ("training_", "system_", "hw_", "process_gpu_")
COMPOSE = "docker-compose.yml"
PROM_CONFIG = "prometheus/prometheus.yml"
ALERTMANAGER = "alertmanager/alertmanager.yml"
DATASOURCES = "grafana/provisioning/datasources"
DASHBOARDS = "grafana/dashboards"
COLLECTORS = "collector-config"
TOOL_TIMEOUT_S = 120
# What collector-config/agent.yaml and gateway.yaml need set to be validated.
GATEWAY_VARIABLES = (
    "OTEL_GATEWAY_CA_FILE",
    "OTEL_GATEWAY_TOKEN_FILE",
    "OTEL_GATEWAY_CERT_FILE",
    "OTEL_GATEWAY_KEY_FILE",
)


def contract_names() -> set[str]:
    """Prometheus names of the contract's metrics, histogram series suffixes included."""
    names: set[str] = set()
    column = None
    for line in (files("otel_training") / "telemetry.md").read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:  # a table's header row
            found = [i for i, c in enumerate(cells) if c.startswith("Prometheus")]
            column = found[0] if found and "OTel name" in cells[0] else -1
        elif column >= 0 and len(cells) > column and not set(cells[0]) <= set("-: "):
            tokens = re.findall(r"`([a-z_0-9]+)`", cells[column])
            if tokens:  # `base` (`_bucket`, `_sum`, `_count`)
                names.add(tokens[0])
                names.update(tokens[0] + t for t in tokens[1:] if t.startswith("_"))
    return names


# PromQL parts that hold no metric name: strings, Grafana variables, label matchers,
# ranges, and the label lists of grouping and vector matching.
_NOT_NAMES = [
    re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'),
    re.compile(r"\$\{[^}]*\}|\$\w+"),
    re.compile(r"\{[^{}]*\}"),
    re.compile(r"\[[^\]]*\]"),
    re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)"),
]
_IDENTIFIER = re.compile(r"(?<![\w:.])[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Names in a PromQL expression that are ours: our families and recording rules (``a:b:c``)."""
    for pattern in _NOT_NAMES:
        expr = pattern.sub(" ", expr)
    return {n for n in _IDENTIFIER.findall(expr) if n.startswith(PREFIXES) or ":" in n}


def _values(node: Any, key: str) -> Iterator[Any]:
    """Every value stored under ``key`` anywhere in a parsed YAML/JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _values(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from _values(item, key)


def _names(value: Any) -> list[str]:
    """A Collector service's list of component names (one name alone is a list of one)."""
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value] if isinstance(value, list) else []


def _parse(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"not valid YAML: {problem}{where}") from None


def _complaint(output: str, limit: int = 300) -> str:
    """The first complaint in a tool's output: its FAILED line and the two after it."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    at = next((i for i, ln in enumerate(lines) if "FAILED" in ln), None)
    if at is None:
        return lines[-1][:limit] if lines else "(no output)"
    text = " ".join([lines[at].split("FAILED", 1)[1].lstrip(": "), *lines[at + 1 : at + 3]])
    return " ".join(text.split()).rstrip(", ")[:limit]


class Checker:
    """Collects one line per fault in ``problems`` and what was run or skipped in ``notes``."""

    def __init__(self, directory: Path, which: Callable[[str], str | None] = shutil.which) -> None:
        self.dir = directory
        self.which = which
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.docs: dict[str, dict] = {}  # path relative to dir -> parsed mapping
        self.broken: set[str] = set()

    def fail(self, rel: str, message: str) -> None:
        self.problems.append(f"{self.dir / rel}: {message}")

    def run(self) -> list[str]:
        self.parse_all()
        self.check_compose()
        self.check_collectors()
        self.check_dashboards()
        self.check_names()
        self.promtool()
        self.amtool()
        self.otelcol()
        return self.problems

    def parse_all(self) -> None:
        for path in sorted(self.dir.rglob("*")):
            rel = path.relative_to(self.dir).as_posix()
            if path.suffix not in (".yml", ".yaml", ".json") or not path.is_file() or "/." in f"/{rel}":
                continue
            try:
                doc = _parse(path)
            except (ValueError, UnicodeDecodeError) as exc:
                self.broken.add(rel)
                self.fail(rel, str(exc))
                continue
            if not isinstance(doc, dict):  # every file of the stack is a mapping at the top
                self.broken.add(rel)
                self.fail(rel, f"expected a mapping at the top, found {type(doc).__name__}")
            else:
                self.docs[rel] = doc

    def _mapping(self, rel: str) -> dict | None:
        """The parsed mapping at ``rel``; None when it is missing (one line) or did not parse."""
        if rel in self.broken:
            return None
        if rel not in self.docs:
            self.fail(rel, "missing (otel-training stack init DIR writes it)")
            return None
        return self.docs[rel]

    def check_compose(self) -> None:
        compose = self._mapping(COMPOSE)
        if compose is None:
            return
        services = compose.get("services")
        if not isinstance(services, dict) or not services:
            self.fail(COMPOSE, "no services: expected a 'services' mapping")
            return
        for name, service in services.items():
            for volume in (service if isinstance(service, dict) else {}).get("volumes") or []:
                source = str(volume).split(":")[0]
                if source.startswith("./") and not (self.dir / source).exists():
                    self.fail(COMPOSE, f"service {name} mounts {source}, which is missing")

    def check_collectors(self) -> None:
        """Every component a Collector config's ``service`` names is defined in that file
        (the Collector itself refuses to start otherwise, after ``docker compose up``)."""
        for rel, doc in sorted(self.docs.items()):
            service = doc.get("service")
            if not rel.startswith(COLLECTORS + "/") or not isinstance(service, dict):
                continue
            connectors = set(doc.get("connectors") or {})
            # a connector is an exporter of one pipeline and a receiver of another
            defined = {kind: set(doc.get(kind) or {}) for kind in ("receivers", "processors", "exporters")}
            defined["receivers"] |= connectors
            defined["exporters"] |= connectors
            for name in _names(service.get("extensions")):
                if name not in set(doc.get("extensions") or {}):
                    self.fail(rel, f"service.extensions names extension {name!r}, which 'extensions' does not define")
            pipelines = service.get("pipelines")
            for pipeline, spec in (pipelines if isinstance(pipelines, dict) else {}).items():
                for kind, known in defined.items():
                    for name in _names((spec or {}).get(kind) if isinstance(spec, dict) else None):
                        if name not in known:
                            have = ", ".join(sorted(known)) or "none"
                            self.fail(
                                rel,
                                f"pipeline {pipeline} names {kind[:-1]} {name!r}, which {kind!r} does not define "
                                f"(defined: {have})",
                            )

    def _dashboards(self) -> list[str]:
        return [rel for rel in self.docs if rel.startswith(DASHBOARDS + "/") and rel.endswith(".json")]

    def check_dashboards(self) -> None:
        provisioned: set[str] = set()
        known = True  # false when a data source file is broken: nothing to compare with
        for rel in [r for r in list(self.docs) + sorted(self.broken) if r.startswith(DATASOURCES + "/")]:
            doc = self._mapping(rel)
            known = known and doc is not None
            for source in (doc or {}).get("datasources") or []:
                if isinstance(source, dict):
                    provisioned.add(str(source.get("uid", "")))
        seen: dict[str, str] = {}
        users: dict[str, list[str]] = {}  # data source uid -> dashboards using it
        for rel in self._dashboards():
            dashboard = self._mapping(rel)
            if dashboard is None:
                continue
            uid = dashboard.get("uid")
            if not isinstance(uid, str) or not uid:
                self.fail(rel, "dashboard has no uid: Grafana would give it a random one on every start")
            elif uid in seen:
                self.fail(rel, f"dashboard uid {uid!r} is also the uid of {seen[uid]}: uids must be unique")
            else:
                seen[uid] = rel
            for source in _values(dashboard, "datasource"):
                ref = source.get("uid") if isinstance(source, dict) else None
                # "$var" is a dashboard variable, "-- Grafana --" a built-in source.
                if isinstance(ref, str) and ref not in provisioned and not ref.startswith(("$", "-- ")):
                    users.setdefault(ref, []).append(Path(rel).name)
        if known:
            for uid, names in sorted(users.items()):
                used_by = ", ".join(sorted(set(names)))
                self.fail(DATASOURCES, f"no data source has uid {uid!r}, which dashboard(s) {used_by} use")
        if not self._dashboards() and not any(r.startswith(DASHBOARDS + "/") for r in self.broken):
            self.fail(DASHBOARDS, "no dashboards (*.json)")

    def check_names(self) -> None:
        rules = [r for r in self.docs if r.startswith("prometheus/rules/")]
        recorded = {str(n) for rel in rules for n in _values(self.docs[rel], "record")}
        # A rules file that did not parse has its line already: its recording rules are unknown.
        rules_known = not any(r.startswith("prometheus/rules/") for r in self.broken)
        contract = contract_names()
        for rel in sorted(rules) + self._dashboards():
            used = set().union(*(metric_names(e) for e in _values(self.docs[rel], "expr") if isinstance(e, str)))
            unknown = sorted(
                n for n in used if n not in contract and n not in recorded and (rules_known or ":" not in n)
            )
            if unknown:
                self.fail(
                    rel,
                    f"metric name(s) not in otel-training's telemetry contract nor recorded by "
                    f"prometheus/rules/: {', '.join(unknown)}",
                )

    def _tool(self, rel: str, argv: list[str], cwd: Path) -> bool:
        """Run a checker; one line naming its first complaint when it fails."""
        try:
            proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.fail(rel, f"could not run {Path(argv[0]).name}: {exc}")
            return False
        if proc.returncode == 0:
            return True
        self.fail(rel, f"{Path(argv[0]).name} {' '.join(argv[1:3])} failed: {_complaint(proc.stdout + proc.stderr)}")
        return False

    def promtool(self) -> None:
        promtool = self.which("promtool")
        prom_dir = self.dir / "prometheus"
        if promtool is None:
            self.notes.append("promtool not on PATH: Prometheus config and rules not checked by it")
            return
        if any(r.startswith("prometheus/") for r in self.broken) or self._mapping(PROM_CONFIG) is None:
            return
        if not self._tool(PROM_CONFIG, [promtool, "check", "config", "prometheus.yml"], prom_dir):
            return
        self.notes.append("promtool check config (and its rule files): passed")
        # One file a run: promtool's report of a failed case does not name its file.
        tests = sorted(p.relative_to(prom_dir).as_posix() for p in (prom_dir / "tests").glob("*.yml"))
        passed = [t for t in tests if self._tool(f"prometheus/{t}", [promtool, "test", "rules", t], prom_dir)]
        if tests:
            self.notes.append(f"promtool test rules: {len(passed)} of {len(tests)} files passed")

    def amtool(self) -> None:
        amtool = self.which("amtool")
        if not (self.dir / ALERTMANAGER).exists():
            return
        if amtool is None:
            self.notes.append("amtool not on PATH: Alertmanager config not checked by it")
            return
        if self._mapping(ALERTMANAGER) is not None and self._tool(
            ALERTMANAGER, [amtool, "check-config", "alertmanager.yml"], self.dir / "alertmanager"
        ):
            self.notes.append("amtool check-config: passed")

    def otelcol(self) -> None:
        """``otelcol validate`` on each Collector config: an unknown key or component stops
        the Collector at start. The agent's and gateway's required variables get stand-ins."""
        otelcol = self.which("otelcol") or self.which("otelcol-contrib")
        configs = sorted((self.dir / COLLECTORS).glob("*.yaml"))
        if otelcol is None:
            self.notes.append("otelcol not on PATH: Collector configs not validated by it")
            return
        env = {**os.environ, **{v: f"/nonexistent/{v.lower()}" for v in GATEWAY_VARIABLES}}
        env["OTEL_GATEWAY_ENDPOINT"] = "gateway.invalid:4317"
        passed = []
        for path in configs:
            rel = path.relative_to(self.dir).as_posix()
            if rel in self.broken:
                continue
            try:
                proc = subprocess.run(
                    [otelcol, "validate", f"--config={path}"],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=TOOL_TIMEOUT_S,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                self.fail(rel, f"could not run otelcol: {exc}")
                continue
            if proc.returncode == 0:
                passed.append(path.name)
            else:
                self.fail(rel, f"otelcol validate failed: {_complaint(proc.stdout + proc.stderr)}")
        if passed:
            self.notes.append(f"otelcol validate: {', '.join(passed)} passed")


def main_check(directory: Path) -> int:
    out, err = sys.stdout, sys.stderr
    if not directory.is_dir():
        print(f"{PROG}: {directory}: no such directory (write one with `otel-training stack init DIR`)", file=err)
        return 2
    checker = Checker(directory)
    problems = checker.run()
    for line in problems:
        print(f"{PROG}: {line}", file=err)
    if problems:
        return 1
    print(f"{PROG}: {directory}: {len(checker.docs)} YAML/JSON files valid", file=out)
    for note in checker.notes:
        print(f"  {note}", file=out)
    return 0
