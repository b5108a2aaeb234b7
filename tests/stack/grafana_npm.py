"""Grafana's Apache-2.0 npm packages, installed by scripts/install-grafana-npm.sh into
.tools/grafana-npm at the versions scripts/grafana-npm/package.json pins, and the node
scripts (tests/stack/npm/) that run them. Missing or stale packages skip the tests that
need them, except under CI=true, where they fail."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.stack.conftest import unavailable
from tests.stack.promserver import ROOT

NPM_DIR = ROOT / ".tools" / "grafana-npm"
PACKAGE_JSON = ROOT / "scripts" / "grafana-npm" / "package.json"
PINNED = json.loads(PACKAGE_JSON.read_text())["dependencies"]
SCRIPTS = Path(__file__).resolve().parent / "npm"
INSTALL = "scripts/install-grafana-npm.sh"


def require_packages() -> Path:
    """NPM_DIR holding every pinned package at its pinned version, and node on PATH."""
    if shutil.which("node") is None:
        unavailable("node is not on PATH (Node.js 18 or later runs Grafana's npm packages)")
    for name, version in PINNED.items():
        meta = NPM_DIR / "node_modules" / name / "package.json"
        if not meta.is_file():
            unavailable(f"{name} is not in .tools/grafana-npm: run {INSTALL}")
        found = json.loads(meta.read_text())["version"]
        if found != version:
            unavailable(f"{name} {found} in .tools/grafana-npm, {version} pinned: run {INSTALL}")
    return NPM_DIR


def run_node(script: str, payload) -> dict:
    """Run tests/stack/npm/``script`` on ``payload`` (JSON on stdin); its JSON answer."""
    proc = subprocess.run(["node", str(SCRIPTS / script), str(NPM_DIR)], input=json.dumps(payload),
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"node {script} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)
