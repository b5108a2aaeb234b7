"""Each known alert mistake has a promtool test of its own, and each of
those tests can fail: run against the rules as they were before the fix
(``data/rules-before-issue-17/``, a verbatim copy), every one of them fails -- a
"false positive" group because the old rule fires where it must stay silent, a
"missed" group because no old rule fires where one must -- and against the
repository's rules it passes (real promtool)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.stack.promserver import PROM_DIR

OLD_RULES = Path(__file__).resolve().parent / "data" / "rules-before-issue-17"
PREFIXES = ("false positive:", "missed:")


def _groups():
    out = []
    for path in sorted((PROM_DIR / "tests").glob("*.yml")):
        # BaseLoader: every scalar a string, as promtool reads them ("0x40" is 0 forty
        # times to promtool, 64 to a YAML 1.1 int resolver).
        for group in yaml.load(path.read_text(), Loader=yaml.BaseLoader)["tests"]:
            if group["name"].startswith(PREFIXES):
                out.append((path.name, group))
    return out


GROUPS = _groups()


def test_each_mistake_of_issue_17_has_a_test():
    names = " | ".join(g["name"] for _, g in GROUPS)
    for alert, words in {
        "TrainingGPUUtilizationLow": "multi-GPU host",
        "TrainingStalled": "training finished, the process stays alive",
        "GPUMemoryNearlyFull": "idle notebook",
        "TelemetryCollectorDown": "every export fails",
    }.items():
        assert words in names, (alert, names)
    assert len(GROUPS) >= 7


def _run(prom_bin, tmp_path, rules_dir: Path, group: dict):
    test_file = tmp_path / "case.test.yml"
    test_file.write_text(yaml.safe_dump({
        "rule_files": [str(rules_dir / "training-recording.yml"), str(rules_dir / "training-alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [group],
    }))
    return subprocess.run([str(prom_bin / "promtool"), "test", "rules", str(test_file)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("file, group", GROUPS, ids=[g["name"] for _, g in GROUPS])
def test_fails_on_the_old_rules_and_passes_on_the_new(prom_bin, tmp_path, file, group):
    old = _run(prom_bin, tmp_path, OLD_RULES, group)
    assert old.returncode != 0, f"{file}: passes on rules without its fix:\n{old.stdout}"
    report = old.stdout + old.stderr
    if group["name"].startswith("false positive:"):
        # the old rule fired where the test expects silence
        assert "exp:[]" in report.replace(" ", "") and "Labels:{alertname=" in report, report
    else:
        assert "got:[]" in report.replace(" ", ""), report  # nothing fired where one must
    new = _run(prom_bin, tmp_path, PROM_DIR / "rules", group)
    assert new.returncode == 0, new.stdout + new.stderr
