"""promtool on the repository's Prometheus config, rules and rule unit tests (real binary)."""

from __future__ import annotations

import subprocess

import pytest

from tests.stack.promserver import PROM_DIR


def _promtool(prom_bin, *args):
    proc = subprocess.run([str(prom_bin / "promtool"), *args], capture_output=True, text=True,
                          cwd=PROM_DIR, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_check_config(prom_bin):
    out = _promtool(prom_bin, "check", "config", "prometheus.yml")
    assert "SUCCESS" in out and "rules found" in out


def test_check_rules(prom_bin):
    rules = sorted(str(p.relative_to(PROM_DIR)) for p in (PROM_DIR / "rules").glob("*.yml"))
    assert rules
    _promtool(prom_bin, "check", "rules", *rules)


@pytest.mark.parametrize("test_file", sorted(p.name for p in (PROM_DIR / "tests").glob("*.yml")))
def test_rule_unit_tests(prom_bin, test_file):
    out = _promtool(prom_bin, "test", "rules", f"tests/{test_file}")
    assert "SUCCESS" in out
