"""``otel-training stack init`` and ``stack check``: the stack written from the
package equals the repository's files, init never overwrites a change unasked, and check
passes on them and fails with one line on each deliberately broken copy (real promtool
and amtool where the case needs them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from otel_training.cli import stack, stack_check
from tests.stack.promserver import ROOT

# The repository's stack: what docker-compose.yml mounts, and the Collector's agent and
# gateway configs beside the one it mounts.
STACK_PATHS = ["docker-compose.yml", "collector-config", "prometheus", "tempo", "grafana", "alertmanager",
               "docs/runbooks.md"]


def repository_stack() -> dict:
    out = {}
    for top in STACK_PATHS:
        path = ROOT / top
        for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            out[f.relative_to(ROOT).as_posix()] = f.read_bytes()
    return out


def written(directory: Path) -> dict:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _init(directory, *flags, capsys):
    code = stack.main(["init", str(directory), *flags])
    out = capsys.readouterr()
    return code, out.out, [ln for ln in out.err.splitlines() if ln.strip()]


@pytest.fixture
def stack_dir(tmp_path, capsys):
    directory = tmp_path / "stack"
    assert _init(directory, capsys=capsys)[0] == 0
    return directory


# --- init ---------------------------------------------------------------------------------

def test_init_writes_exactly_the_repository_stack(stack_dir):
    assert written(stack_dir) == repository_stack()
    compose = (stack_dir / "docker-compose.yml").read_text()
    for source in re.findall(r"^\s+- (\./[^:]+):", compose, re.M):  # every bind mount has its file
        assert (stack_dir / source).exists(), source


def test_init_again_changes_nothing_and_says_so(stack_dir, capsys):
    before = {p: p.stat().st_mtime_ns for p in stack_dir.rglob("*") if p.is_file()}
    code, out, err = _init(stack_dir, capsys=capsys)
    assert code == 0 and not err
    assert f"wrote 0 stack files to {stack_dir}, {len(before)} already up to date" in out
    assert {p: p.stat().st_mtime_ns for p in stack_dir.rglob("*") if p.is_file()} == before


def test_init_refuses_to_overwrite_a_changed_file_unless_forced(stack_dir, capsys):
    rules = stack_dir / "prometheus" / "rules" / "training-alerts.yml"
    rules.write_text(rules.read_text() + "\n# my change\n")
    (stack_dir / "tempo" / "tempo.yaml").unlink()  # a missing file is not written either
    code, out, err = _init(stack_dir, capsys=capsys)
    assert code == 1
    assert len(err) == 1, err
    assert "prometheus/rules/training-alerts.yml" in err[0] and "--force" in err[0] and "nothing written" in err[0]
    assert rules.read_text().endswith("# my change\n")
    assert not (stack_dir / "tempo" / "tempo.yaml").exists()

    code, out, err = _init(stack_dir, "--force", capsys=capsys)
    assert code == 0 and not err
    assert "wrote 2 stack files" in out and "1 overwritten" in out
    assert written(stack_dir) == repository_stack()


def test_init_into_a_file_is_one_line(tmp_path, capsys):
    target = tmp_path / "stack"
    target.write_text("not a directory")
    code, out, err = _init(target, capsys=capsys)
    assert code == 2 and len(err) == 1 and "is a file, not a directory" in err[0]


def test_written_files_are_readable_by_the_containers(stack_dir):
    # Prometheus, Grafana and Tempo run as other users than the one who wrote the files.
    modes = {p.stat().st_mode & 0o777 for p in stack_dir.rglob("*") if p.is_file()}
    assert modes == {0o644}


def test_the_command_line_runs_it(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "otel_training.cli", "stack", "init", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "docker compose up -d" in proc.stdout and (tmp_path / "s" / "docker-compose.yml").is_file()
    proc = subprocess.run([sys.executable, "-m", "otel_training.cli", "stack"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2 and "init" in proc.stderr and "check" in proc.stderr


# --- check --------------------------------------------------------------------------------

def _check(directory, which=lambda name: None):
    checker = stack_check.Checker(directory, which=which)
    return checker.run(), checker.notes


def test_contract_names_are_the_contracts(tmp_path):
    from tests.test_contract import HISTOGRAM, ROWS

    expected = {prom for _, _, _, prom in ROWS}
    expected |= {prom + s for _, kind, _, prom in ROWS if kind == HISTOGRAM for s in ("_bucket", "_sum", "_count")}
    assert stack_check.contract_names() == expected


def test_metric_names_skip_labels_strings_and_variables():
    expr = ('sum by (job, training_rank) (rate(training_steps_total{training_phase="hw_x"}[$__rate_interval]))'
            ' / on (training_run_id) group_left (host_name) job_run_rank:training_steps:rate5m'
            ' + label_replace(hw_gpu_utilization_ratio, "training_dst", "$1", "training_src", "(.*)")'
            ' * ignoring(training_mode) system_cpu_utilization_ratio offset 5m')
    assert stack_check.metric_names(expr) == {
        "training_steps_total", "job_run_rank:training_steps:rate5m", "hw_gpu_utilization_ratio",
        "system_cpu_utilization_ratio"}


def test_check_passes_on_the_written_stack_without_tools(stack_dir):
    problems, notes = _check(stack_dir)
    assert problems == []
    assert any("promtool not on PATH" in n for n in notes) and any("amtool not on PATH" in n for n in notes)


def _tools(stack_bin):
    return {name: str(stack_bin / name) for name in ("promtool", "amtool", "otelcol")}


def test_check_passes_with_promtool_amtool_and_otelcol(stack_dir, stack_bin, capsys):
    problems, notes = _check(stack_dir, _tools(stack_bin).get)
    assert problems == []
    tests = len(list((stack_dir / "prometheus" / "tests").glob("*.yml")))
    assert f"promtool test rules: {tests} of {tests} files passed" in notes
    assert "amtool check-config: passed" in notes
    assert "otelcol validate: agent.yaml, config.yaml, gateway.yaml passed" in notes


def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, count))


# (what to break, the file the one line must name, words it must say)
BROKEN = {
    "rules: not YAML": (lambda d: _edit(d / "prometheus/rules/training-alerts.yml", "groups:", "groups: ["),
                        "prometheus/rules/training-alerts.yml", "not valid YAML"),
    "recording rules: not YAML": (lambda d: _edit(d / "prometheus/rules/training-recording.yml", "  - name:",
                                                  "  - name: ["),
                                  "prometheus/rules/training-recording.yml", "not valid YAML"),
    "dashboard: not JSON": (lambda d: _edit(d / "grafana/dashboards/hardware.json", '"title":', '"title" "x",'),
                            "grafana/dashboards/hardware.json", "not valid JSON"),
    "dashboard uid twice": (lambda d: _edit(d / "grafana/dashboards/training.json", '"uid": "otel-training-training"',
                                            '"uid": "otel-training-hardware"'),
                            "grafana/dashboards/training.json", "also the uid of grafana/dashboards/hardware.json"),
    "dashboard without uid": (lambda d: _edit(d / "grafana/dashboards/training.json",
                                              '"uid": "otel-training-training"', '"uid": ""'),
                              "grafana/dashboards/training.json", "has no uid"),
    "name not in the contract": (lambda d: _edit(d / "grafana/dashboards/training.json", "rate(training_samples_total",
                                                 "rate(training_sample_total"),
                                 "grafana/dashboards/training.json", "not in otel-training's telemetry contract"),
    "recording rule renamed": (lambda d: _edit(d / "prometheus/rules/training-recording.yml",
                                               "record: job_run_rank:training_steps:rate5m",
                                               "record: job_run_rank:training_steps:rate1m"),
                               "grafana/dashboards/training.json", "job_run_rank:training_steps:rate5m"),
    "mounted file missing": (lambda d: (d / "tempo/tempo.yaml").unlink(),
                             "docker-compose.yml", "mounts ./tempo/tempo.yaml, which is missing"),
    "data source uid changed": (lambda d: _edit(d / "grafana/provisioning/datasources/datasources.yaml",
                                                "uid: otel-training-prometheus", "uid: prom"),
                                "grafana/provisioning/datasources", "no data source has uid 'otel-training-prom"),
    "collector: undefined exporter": (lambda d: _edit(d / "collector-config/config.yaml",
                                                      "exporters: [otlp_grpc/tempo]", "exporters: [otlp_grpc/tmpo]"),
                                      "collector-config/config.yaml",
                                      "pipeline traces names exporter 'otlp_grpc/tmpo', which 'exporters' does not "
                                      "define (defined: otlp_grpc/tempo, otlp_http/prometheus)"),
    "collector: undefined processor": (lambda d: _edit(d / "collector-config/gateway.yaml", "processors: [memory_limiter,",
                                                       "processors: [memory_limit,"),
                                       "collector-config/gateway.yaml", "names processor 'memory_limit'"),
    "collector: undefined extension": (lambda d: _edit(d / "collector-config/agent.yaml",
                                                       "extensions: [health_check, bearertokenauth/gateway]",
                                                       "extensions: [health_check, bearertokenauth/gw]"),
                                       "collector-config/agent.yaml",
                                       "service.extensions names extension 'bearertokenauth/gw'"),
    "prometheus.yml: no mapping": (lambda d: (d / "prometheus/prometheus.yml").write_text("- a\n"),
                                   "prometheus/prometheus.yml", "expected a mapping at the top, found list"),
}
NEEDS_TOOLS = {  # faults only the real tools see
    "rule: bad PromQL": (lambda d: _edit(d / "prometheus/rules/training-alerts.yml", "expr: ", "expr: sum(("),
                         "prometheus/prometheus.yml", "could not parse expression"),
    "rule test: wrong expectation": (lambda d: _edit(d / "prometheus/tests/stalled.test.yml",
                                                     'summary: "Run run-1 rank 1', 'summary: "Run run-9 rank 1'),
                                     "prometheus/tests/stalled.test.yml", "promtool test rules failed"),
    "alertmanager: unknown field": (lambda d: _edit(d / "alertmanager/alertmanager.yml", "receiver: ", "receivr: "),
                                    "alertmanager/alertmanager.yml", "receivr not found"),
    # one unknown key stops the Collector for every user: only the Collector itself knows its keys
    "collector: unknown key": (lambda d: _edit(d / "collector-config/gateway.yaml", "check_interval: 1s",
                                               "check_intervall: 1s"),
                               "collector-config/gateway.yaml", "otelcol validate failed"),
}


def _one_line(stack_dir, capsys, which, break_it, where, words):
    break_it(stack_dir)
    problems, _ = _check(stack_dir, which)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{stack_dir / where}: ") and words in problems[0], problems[0]


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_copy_fails_with_one_line(stack_dir, capsys, case):
    _one_line(stack_dir, capsys, lambda name: None, *BROKEN[case])


@pytest.mark.parametrize("case", sorted(NEEDS_TOOLS))
def test_a_copy_only_the_tools_reject_fails_with_one_line(stack_dir, capsys, stack_bin, case):
    _one_line(stack_dir, capsys, _tools(stack_bin).get, *NEEDS_TOOLS[case])


def test_check_on_the_command_line(stack_dir, prom_bin, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{prom_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    cmd = [sys.executable, "-m", "otel_training.cli", "stack", "check", str(stack_dir)]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    assert "YAML/JSON files valid" in ok.stdout and "promtool check config" in ok.stdout
    board = stack_dir / "grafana" / "dashboards" / "hardware.json"
    doc = json.loads(board.read_text())
    board.write_text(json.dumps(doc)[:-20])  # truncated, as by a failed copy
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith(f"otel-training stack check: {board}: not valid JSON")
    missing = subprocess.run(cmd[:-1] + [str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120,
                             env=env)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such directory" in missing.stderr
