"""Fixtures of the stack tests: the real stack's binaries, a real instrumented training
run translated as Prometheus 3 would store it, and a Prometheus holding it.

Binaries come from ``scripts/install-stack.sh`` (the Collector, Prometheus and promtool,
Jaeger) and ``scripts/install-alertmanager.sh`` (run here when missing). If they cannot
obtain them the tests that need them skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import pytest

from tests.stack import real_run, synthetic
from tests.stack.prom_translate import Translator, promoted_attributes, translate
from tests.stack.promserver import ROOT, Prometheus, stack_config

BIN = ROOT / ".tools" / "bin"
INSTALL = ROOT / "scripts" / "install-stack.sh"
INSTALL_ALERTMANAGER = ROOT / "scripts" / "install-alertmanager.sh"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def unavailable(reason: str):
    """Skip, or fail under CI=true: CI must run the real-tool tests."""
    if _in_ci():
        pytest.fail(f"{reason} (CI=true: not skipping)")
    pytest.skip(reason)


def _works(binary: Path) -> bool:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return False
    return out.returncode == 0 and " version 3." in (out.stdout + out.stderr)


@pytest.fixture(scope="session")
def prom_bin() -> Path:
    """Directory holding prometheus and promtool 3.x."""
    if not (_works(BIN / "prometheus") and _works(BIN / "promtool")):
        proc = subprocess.run(["bash", str(INSTALL), "prometheus"], capture_output=True, text=True, timeout=1200)
        if not (_works(BIN / "prometheus") and _works(BIN / "promtool")):
            unavailable("scripts/install-stack.sh could not build Prometheus 3 and promtool: "
                        + (proc.stderr.strip().splitlines() or ["no output"])[-1])
    return BIN


def _runs_ok(binary: Path) -> bool:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return False
    return out.returncode == 0 and " version " in (out.stdout + out.stderr)


@pytest.fixture(scope="session")
def am_bin() -> Path:
    """Directory holding alertmanager and amtool (scripts/install-alertmanager.sh)."""
    if not (_runs_ok(BIN / "alertmanager") and _runs_ok(BIN / "amtool")):
        proc = subprocess.run(["bash", str(INSTALL_ALERTMANAGER)], capture_output=True, text=True, timeout=900)
        if not (_runs_ok(BIN / "alertmanager") and _runs_ok(BIN / "amtool")):
            unavailable("scripts/install-alertmanager.sh could not obtain Alertmanager and amtool: "
                        + (proc.stderr.strip().splitlines() or ["no output"])[-1])
    return BIN


@pytest.fixture(scope="session")
def stack_bin(prom_bin, am_bin) -> Path:
    """Directory holding every binary ``otel-training stack up`` runs."""
    def runs(name):
        try:
            flag = "version" if name == "jaeger" else "--version"  # jaeger has a subcommand, no flag
            return subprocess.run([str(BIN / name), flag], capture_output=True, timeout=30).returncode == 0
        except OSError:
            return False
    if not (runs("otelcol") and runs("jaeger")):
        proc = subprocess.run(["bash", str(INSTALL), "otelcol", "jaeger"], capture_output=True, text=True,
                              timeout=1200)
        if not (runs("otelcol") and runs("jaeger")):
            unavailable("scripts/install-stack.sh could not build the Collector and Jaeger: "
                        + (proc.stderr.strip().splitlines() or ["no output"])[-1])
    return BIN


@dataclass
class RunData:
    """Series of the real run and of the synthetic supplement, with their label values."""

    real: Translator
    synthetic: Translator
    trace_ids: set
    real_values: Dict[str, str] = field(default_factory=dict)
    synthetic_values: Dict[str, str] = field(default_factory=dict)
    real_requests: list = field(default_factory=list)  # the OTLP export requests, as received
    synthetic_requests: list = field(default_factory=list)
    real_runs: List[str] = field(default_factory=list)  # training_run_id of each concurrent run
    synthetic_runs: List[str] = field(default_factory=list)


def _values(tr: Translator) -> Dict[str, str]:
    """One value per dashboard variable, from the rank-0 training series and GPU 0."""
    steps = tr.families["training_steps_total"].samples
    labels = dict(sorted(steps)[0][1:])
    out = {k: labels.get(k, "") for k in ("job", "training_run_id", "host_name", "training_rank")}
    gpu = tr.families.get("hw_gpu_utilization_ratio")
    if gpu is not None:
        out["gpu_index"] = sorted(dict(k[1:])["gpu_index"] for k in gpu.samples)[0]
    return out


def _runs(tr: Translator) -> List[str]:
    return sorted({dict(k[1:])["training_run_id"] for k in tr.families["training_steps_total"].samples})


@pytest.fixture(scope="session")
def run_data() -> RunData:
    """Two real two-rank instrumented training runs of one job on this host, at the same
    time (real_run.CONCURRENT), exported over OTLP and translated."""
    if not real_run.available():
        unavailable("otel_training (the core package) or examples/train_basic.py is missing")
    from tests.otlp_receiver import OTLPReceiver

    promote = promoted_attributes(str(ROOT / "prometheus" / "prometheus.yml"))
    with OTLPReceiver() as receiver:
        real_run.run_concurrently(receiver.endpoint, real_run.CONCURRENT)
        real_requests = list(receiver.metric_requests)
        real = translate(real_requests, promote)
        trace_ids = {span.trace_id.hex() for _, span in receiver.spans()}
    with OTLPReceiver() as receiver:
        synthetic.produce(receiver.endpoint, seconds=6.0, interval_ms=100, runs=2)  # 60 exports each
        synth_requests = list(receiver.metric_requests)
        synth = translate(synth_requests, promote)
    return RunData(real, synth, trace_ids, _values(real), _values(synth), real_requests,
                   synth_requests, _runs(real), _runs(synth))


@pytest.fixture(scope="module")
def prometheus(prom_bin, run_data, tmp_path_factory) -> Prometheus:
    """A real Prometheus over both runs' series, evaluating the repository's rules."""
    prom = Prometheus(prom_bin, tmp_path_factory.mktemp("prometheus"))
    prom.load(run_data.real.openmetrics(), "real")
    prom.load(run_data.synthetic.openmetrics(), "synthetic")
    prom.start(stack_config())
    try:
        prom.wait_for_rules()
        time.sleep(1.5)  # a second evaluation: rate() over recorded series needs two points
        yield prom
    finally:
        prom.stop()
