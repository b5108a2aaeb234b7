"""Alerts reach someone: alertmanager/alertmanager.yml with the real Alertmanager and
amtool, and a delivery from end to end -- real Prometheus, evaluating the repository's
rules on a recorded real run, sends to a real Alertmanager, which routes by severity,
inhibits the warnings of a process that has a critical alert, and posts to a webhook
receiver on loopback. Everything listens on 127.0.0.1 and stops at the end of the test.

The only changes to the shipped files are the ones a test must make: the receivers'
webhook URLs point at the test's receiver, the grouping waits are 1 s instead of
minutes, and the alert rules' ``for`` durations are 0 (the same expressions, labels and
annotations), so that a rule fires on its first evaluation instead of after 10 minutes.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import List, Optional

import pytest
import yaml

from tests.stack.promserver import PROM_DIR, ROOT, Prometheus, free_port, stack_config

pytestmark = pytest.mark.slow

AM_CONFIG = ROOT / "alertmanager" / "alertmanager.yml"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _amtool(am_bin, *args) -> str:
    proc = subprocess.run([str(am_bin / "amtool"), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_amtool_accepts_the_config(am_bin):
    out = _amtool(am_bin, "check-config", str(AM_CONFIG))
    assert "SUCCESS" in out and "1 inhibit rules" in out


@pytest.mark.parametrize("severity, receiver", [("critical", "critical"), ("warning", "warning"),
                                                 ("info", "info"), ("", "warning")])
def test_alerts_are_routed_by_severity(am_bin, severity, receiver):
    labels = ["alertname=TrainingStalled", "job=train"] + ([f"severity={severity}"] if severity else [])
    out = _amtool(am_bin, "config", "routes", "test", f"--config.file={AM_CONFIG}", *labels)
    assert out.split() == [receiver]


def test_every_rule_severity_has_a_route():
    config = yaml.safe_load(AM_CONFIG.read_text())
    routed = {m.split("=", 1)[1].strip('"') for r in config["route"]["routes"] for m in r["matchers"]}
    severities = {r["labels"]["severity"] for path in (PROM_DIR / "rules").glob("*.yml")
                  for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert severities <= routed
    (inhibit,) = config["inhibit_rules"]
    assert inhibit["source_matchers"] == ['severity="critical"']
    assert set(inhibit["equal"]) == {"job", "instance"}


def test_compose_runs_alertmanager_and_prometheus_sends_to_it():
    am = COMPOSE["services"]["alertmanager"]
    assert am["image"].startswith("prom/alertmanager:v0.")
    assert "./alertmanager/alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro" in am["volumes"]
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in am["command"]
    assert "--cluster.listen-address=" in am["command"]  # no gossip listener
    assert all(str(p).startswith("127.0.0.1:") for p in am["ports"])
    prom = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    targets = [t for a in prom["alerting"]["alertmanagers"] for s in a["static_configs"] for t in s["targets"]]
    assert targets == ["alertmanager:9093"]


# --- end to end ---------------------------------------------------------------------------

class Webhook:
    """A webhook receiver on loopback: keeps every notification posted to it, by path."""

    def __init__(self) -> None:
        received: List[tuple] = []
        lock = threading.Lock()
        self.received, self.lock = received, lock

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    received.append((self.path, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self, path: str) -> List[dict]:
        with self.lock:
            return [a for p, body in self.received if p == path for a in body["alerts"]]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Alertmanager:
    def __init__(self, bin_dir: Path, workdir: Path, config: dict) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (workdir / "alertmanager.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "alertmanager.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [str(bin_dir / "alertmanager"), f"--config.file={workdir / 'alertmanager.yml'}",
                 f"--storage.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--cluster.listen-address=", f"--web.external-url={self.url}"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"alertmanager exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"alertmanager not ready:\n{self.log.read_text()[-3000:]}")

    def alerts(self) -> List[dict]:
        with urllib.request.urlopen(self.url + "/api/v2/alerts?inhibited=true&silenced=true&active=true",
                                    timeout=10) as resp:
            return json.load(resp)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _delivery_config(webhook_url: str) -> dict:
    """The shipped routing, inhibition and receivers; webhooks on loopback, 1 s waits."""
    config = yaml.safe_load(AM_CONFIG.read_text())
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{webhook_url}/{receiver['name']}"
    routes = [config["route"], *config["route"].get("routes", [])]
    for route in routes:
        for key in ("group_wait", "group_interval"):
            if key in route or route is config["route"]:
                route[key] = "1s"
    return config


def _rules_without_for(workdir: Path) -> Path:
    """prometheus/rules/training-alerts.yml with every ``for`` set to 0."""
    rules = yaml.safe_load((PROM_DIR / "rules" / "training-alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    path = workdir / "training-alerts.yml"
    path.write_text(yaml.safe_dump(rules))
    return path


def _data_bound_processes(run_data) -> dict:
    """instance -> labels of the real run's processes that wait for data > 25% of a step."""
    tr = run_data.real
    def last(name, **match):
        out = {}
        for key, points in tr.families[name.rsplit("_", 1)[0]].samples.items():
            labels = dict(key[1:])
            if key[0] == name and all(labels.get(k) == v for k, v in match.items()):
                out[labels["instance"]] = out.get(labels["instance"], 0) + points[max(points)]
        return out
    steps = last("training_step_duration_seconds_sum")
    waits = last("training_phase_duration_seconds_sum", training_phase="dataloader_next", training_phase_parent="step")
    bound = {i for i in steps if steps[i] and waits.get(i, 0) / steps[i] > 0.4}
    gauges = {dict(k[1:])["instance"]: dict(k[1:])
              for k in tr.families["training_phase_open_duration_seconds"].samples}
    return {i: gauges[i] for i in bound if i in gauges}


def _wait_for(predicate, timeout: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def _alert(alerts: List[dict], name: str, **labels) -> Optional[dict]:
    for a in alerts:
        if a["labels"]["alertname"] == name and all(a["labels"].get(k) == v for k, v in labels.items()):
            return a
    return None


def test_prometheus_alert_reaches_a_webhook_through_alertmanager(prom_bin, am_bin, run_data, tmp_path):
    """The recorded run is data-loading bound (its dataset sleeps 20 ms a batch): both of
    its ranks meet TrainingDataLoadingBound (warning). Then its rank 0 hangs: a phase open
    for 20 minutes (TrainingStalled, critical). And the Collector cannot be scraped
    (TelemetryCollectorDown, critical). Expected at the webhook: the two critical alerts
    on the critical receiver, rank 1's warning on the warning receiver, and no warning for
    rank 0, which Alertmanager holds back as inhibited by its critical alert."""
    bound = _data_bound_processes(run_data)
    assert len(bound) >= 2, bound
    victim, *others = sorted(bound.values(), key=lambda labels: labels.get("training_rank", ""))
    others = [o for o in others if o["training_run_id"] == victim["training_run_id"]]
    assert others, bound

    webhook = Webhook()
    am = prom = None
    try:
        am = Alertmanager(am_bin, tmp_path, _delivery_config(webhook.url))
        prom = Prometheus(prom_bin, tmp_path / "prometheus")
        now = time.time()
        shift = int((now - 5) * 1000) - run_data.real.time_range_ms()[1]
        prom.load(run_data.real.openmetrics(shift_ms=shift), "real-run")
        stuck = ",".join(f'{k}="{v}"' for k, v in sorted(victim.items()))
        prom.load("# TYPE training_phase_open_duration_seconds gauge\n"
                  + "".join(f"training_phase_open_duration_seconds{{{stuck}}} {1200 + i} {now - 3 + i:.3f}\n"
                            for i in range(4)) + "# EOF\n", "rank0-hangs")
        assets = tmp_path / "user"
        assets.mkdir()
        shutil.copy(ROOT / "docs" / "runbooks.md", assets / "runbooks.md")
        dead = free_port()  # nothing listens there: the Collector is down
        config = stack_config(alertmanager=f"127.0.0.1:{am.port}")
        config["scrape_configs"] = [{"job_name": "otel-collector", "scrape_interval": "1s",
                                     "static_configs": [{"targets": [f"127.0.0.1:{dead}"]}]}]
        rules = [str(PROM_DIR / "rules" / "training-recording.yml"), str(_rules_without_for(tmp_path))]
        # As in a running stack, Prometheus knows its Alertmanager before the rules fire
        # (alerts of an evaluation before that are dropped and resent a minute later).
        prom.start({**config, "rule_files": []}, extra_args=[
            f"--web.external-url={prom.url}", f"--web.user-assets={assets}", "--web.enable-lifecycle"])
        assert _wait_for(lambda: prom.api("/api/v1/alertmanagers", {}, "GET")["activeAlertmanagers"], 30)
        prom.reload({**config, "rule_files": rules})

        hung = dict(name="TrainingStalled", instance=victim["instance"])
        delivered = _wait_for(lambda: _alert(webhook.alerts("/critical"), **hung)
                              and _alert(webhook.alerts("/critical"), "TelemetryCollectorDown")
                              and _alert(webhook.alerts("/warning"), "TrainingDataLoadingBound",
                                         instance=others[0]["instance"]))
        assert delivered, (f"received: {webhook.received}\nprometheus alerts: "
                           f"{prom.api('/api/v1/alerts', {}, 'GET')}\n{am.log.read_text()[-2000:]}")

        stalled = _alert(webhook.alerts("/critical"), **hung)
        assert stalled["status"] == "firing" and stalled["labels"]["severity"] == "critical"
        assert stalled["labels"]["training_run_id"] == victim["training_run_id"]
        assert "stuck in one phase for 20m" in stalled["annotations"]["summary"]
        down = _alert(webhook.alerts("/critical"), "TelemetryCollectorDown")
        assert down["labels"]["instance"] == f"127.0.0.1:{dead}"
        warning = _alert(webhook.alerts("/warning"), "TrainingDataLoadingBound", instance=others[0]["instance"])
        assert warning["labels"]["severity"] == "warning"
        assert warning["generatorURL"].startswith(prom.url)

        # The runbook link is absolute, and Prometheus serves the runbook there.
        runbook = stalled["annotations"]["runbook_url"]
        assert runbook == f"{prom.url}/user/runbooks.md#trainingstalled"
        with urllib.request.urlopen(runbook.split("#")[0], timeout=10) as resp:
            assert resp.status == 200 and "## TrainingStalled" in resp.read().decode()

        # Rank 0's own warning reached Alertmanager, which holds it back: inhibited.
        held = None
        for _ in range(20):
            held = _alert(am.alerts(), "TrainingDataLoadingBound", instance=victim["instance"])
            if held:
                break
            time.sleep(0.5)
        assert held and held["status"]["state"] == "suppressed" and held["status"]["inhibitedBy"], held
        time.sleep(3)  # several group intervals later, still never delivered
        assert not _alert(webhook.alerts("/warning"), "TrainingDataLoadingBound", instance=victim["instance"])
        # Each receiver got only its own severity; "info" has no webhook at all.
        assert {a["labels"]["severity"] for a in webhook.alerts("/critical")} == {"critical"}
        assert {a["labels"]["severity"] for a in webhook.alerts("/warning")} == {"warning"}
        assert {p for p, _ in webhook.received} <= {"/critical", "/warning"}
    finally:
        if prom is not None:
            prom.stop()
        if am is not None:
            am.stop()
        webhook.close()


def test_nothing_listens_beyond_loopback_while_it_runs(am_bin, tmp_path):
    """Alertmanager as the test runs it (and as compose runs it: no cluster listener)
    opens its web port on 127.0.0.1 and nothing else."""
    am = Alertmanager(am_bin, tmp_path, _delivery_config("http://127.0.0.1:9"))
    try:
        listening = _listening_ports(am.proc.pid)
        assert listening, "no listening socket found"
        assert listening == {("127.0.0.1", am.port)}, listening
    finally:
        am.stop()


def _listening_ports(pid: int) -> set:
    """(address, port) of the TCP sockets a process listens on, from /proc."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = fd.readlink() if hasattr(fd, "readlink") else Path(str(fd.resolve()))
        except OSError:
            continue
        text = str(target)
        if text.startswith("socket:["):
            inodes.add(text[8:-1])
    out = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            raw = bytes.fromhex(addr_hex)
            if family == socket.AF_INET:
                addr = socket.inet_ntop(family, raw[::-1])
            else:
                addr = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            out.add((addr, int(port_hex, 16)))
    return out
