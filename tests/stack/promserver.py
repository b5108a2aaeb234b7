"""A real Prometheus 3 on a loopback port for the stack tests.

Series are loaded the way Debian's build allows (it has no OTLP receiver): OpenMetrics
text -> ``promtool tsdb create-blocks-from openmetrics`` into the data directory, then
``prometheus`` starts over it with the repository's prometheus.yml (its ``otlp`` and
``storage`` settings) and rule files, evaluating every second.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "prometheus"


class PromError(RuntimeError):
    """Prometheus rejected a query (bad PromQL, unknown function...)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stack_config(scrape_targets: List[str] = (), alertmanager: Optional[str] = None) -> dict:
    """prometheus.yml with absolute rule paths, 1 s evaluation, only the given targets, and
    alerts sent to the given Alertmanager (host:port) or nowhere."""
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"]["evaluation_interval"] = "1s"
    config["global"]["scrape_interval"] = "1s"
    config["rule_files"] = [str(PROM_DIR / pattern) for pattern in config["rule_files"]]
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    else:
        config.pop("alerting", None)
    config["scrape_configs"] = [{
        "job_name": "exposition", "scrape_interval": "1s", "honor_labels": True,
        "static_configs": [{"targets": list(scrape_targets)}],
    }] if scrape_targets else []
    return config


class Prometheus:
    """``load()`` series, ``start()``, then ``query``/``query_range``/``label_values``."""

    def __init__(self, bin_dir: Path, workdir: Path) -> None:
        self.prometheus = str(bin_dir / "prometheus")
        self.promtool = str(bin_dir / "promtool")
        self.workdir = Path(workdir)
        self.data = self.workdir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: Optional[subprocess.Popen] = None
        self.log = self.workdir / "prometheus.log"

    def load(self, openmetrics: str, name: str = "series") -> None:
        """Backfill OpenMetrics text (with timestamps) into the data directory."""
        path = self.workdir / f"{name}.om"
        path.write_text(openmetrics)
        proc = subprocess.run([self.promtool, "tsdb", "create-blocks-from", "openmetrics",
                               str(path), str(self.data)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"promtool create-blocks-from failed: {proc.stderr or proc.stdout}")

    def start(self, config: dict, timeout: float = 30.0, extra_args: List[str] = ()) -> "Prometheus":
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        with open(self.log, "w") as log:
            self._proc = subprocess.Popen(
                [self.prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={self.data}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--enable-feature=exemplar-storage",
                 "--storage.tsdb.retention.time=30d", *extra_args],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def reload(self, config: dict) -> None:
        """Apply a new configuration (needs ``--web.enable-lifecycle``)."""
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        req = urllib.request.Request(self.url + "/-/reload", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None

    # -- HTTP API ---------------------------------------------------------------------
    def api(self, path: str, params: Dict[str, str], method: str = "POST") -> dict:
        data = urllib.parse.urlencode(params, doseq=True)
        if method == "GET":
            req = urllib.request.Request(f"{self.url}{path}?{data}")
        else:
            req = urllib.request.Request(self.url + path, data=data.encode(), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                body = json.loads(text)
            except ValueError:
                raise PromError(f"HTTP {exc.code}: {text[:300]}") from None
            raise PromError(f"{body.get('errorType')}: {body.get('error')}") from None
        if body.get("status") != "success":
            raise PromError(str(body))
        return body["data"]

    def query(self, expr: str, at: Optional[float] = None) -> list:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("/api/v1/query", params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list:
        return self.api("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}",
                                                "end": f"{end:.3f}", "step": f"{step:g}"})["result"]

    def label_values(self, label: str, match: str, start: float, end: float) -> list:
        return self.api(f"/api/v1/label/{label}/values",
                        {"match[]": match, "start": f"{start:.3f}", "end": f"{end:.3f}"}, "GET")

    def exemplars(self, expr: str, start: float, end: float) -> list:
        return self.api("/api/v1/query_exemplars",
                        {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}"})

    def rules(self) -> list:
        return self.api("/api/v1/rules", {}, "GET")["groups"]

    def wait_for_rules(self, timeout: float = 30.0) -> None:
        """Until every rule group has been evaluated at least once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            groups = self.rules()
            if groups and all(not g["lastEvaluation"].startswith("0001") for g in groups):
                return
            time.sleep(0.5)
        raise RuntimeError("rule groups were not evaluated in time")
