"""A real headless Chromium, driven over the DevTools protocol through a pipe
(``--remote-debugging-pipe``: file descriptors 3 and 4, NUL-separated JSON), with
nothing but the standard library.

``load(path)`` opens a local HTML file from ``file://`` with the network off three
ways (DevTools offline emulation, a dead proxy, a host resolver that finds
nothing), records every request the page makes, every script error and console
error, measures each chart's canvas and takes a full-page screenshot.

    python -m tests.browser report.html shot.png [WIDTH]   # a screenshot of a report
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")

# Per chart: its canvas size and how many pixels are neither transparent nor white.
_MEASURE = r"""
(() => {
  const out = [];
  for (const el of document.querySelectorAll('[data-chart]')) {
    const c = el.querySelector('canvas');
    const item = {id: el.getAttribute('data-chart'), rendered: el.getAttribute('data-rendered') === 'true',
                  canvas: !!c, width: 0, height: 0, inked: 0, colors: 0,
                  title: (el.querySelector('.u-title') || {}).textContent || ''};
    if (c) {
      item.width = c.width; item.height = c.height;
      const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      const seen = new Set();
      for (let i = 0; i < d.length; i += 4) {
        if (d[i + 3] > 0 && !(d[i] > 245 && d[i + 1] > 245 && d[i + 2] > 245)) {
          item.inked++;
          if (seen.size < 64) seen.add((d[i] >> 4) + ',' + (d[i + 1] >> 4) + ',' + (d[i + 2] >> 4));
        }
      }
      item.colors = seen.size;
    }
    out.push(item);
  }
  return JSON.stringify({charts: out, state: window.otelTrainingReport || null,
                         title: document.title, height: document.documentElement.scrollHeight});
})()
"""


def find_chromium() -> Optional[str]:
    env = os.environ.get("OTEL_TRAINING_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    """One headless Chromium process and one page."""

    def __init__(self, executable: str, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="otel-training-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._res_r, res_w = os.pipe()

        def fds():  # the child's fd 3 reads commands, fd 4 writes answers
            high_r, high_w = os.dup(cmd_r) + 100, os.dup(res_w) + 100
            os.dup2(cmd_r, high_r)  # out of the way first: the pipes may be fds 3 and 4 already
            os.dup2(res_w, high_w)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        self.proc = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
             "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
             f"--user-data-dir={self.profile}", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(cmd_r)
        os.close(res_w)
        self._buf = b""
        self._id = 0
        self.events: List[Dict[str, Any]] = []
        self.session: Optional[str] = None

    # -- protocol -----------------------------------------------------------------------
    def _read(self, deadline: float) -> Dict[str, Any]:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium did not answer")
            chunk = os.read(self._res_r, 1 << 16)
            if not chunk:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
                raise RuntimeError(f"Chromium closed the DevTools pipe: {err[-2000:]}")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: Optional[dict] = None, session: bool = True) -> Dict[str, Any]:
        self._id += 1
        msg: Dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            answer = self._read(deadline)
            if answer.get("id") == self._id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self.events.append(answer)

    def wait_event(self, method: str, timeout: Optional[float] = None) -> Dict[str, Any]:
        for e in self.events:
            if e.get("method") == method:
                return e
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            e = self._read(deadline)
            self.events.append(e)
            if e.get("method") == method:
                return e

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for fd in (self._cmd_w, self._res_r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    # -- a page -------------------------------------------------------------------------
    def open(self, width: int = 1400, height: int = 900) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Page", "Network", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        self.send("Network.emulateNetworkConditions",
                  {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def load(self, path: Path, screenshot: Optional[Path] = None, width: int = 1400) -> Dict[str, Any]:
        """Open ``path`` from file://; what the page did and how its charts look."""
        self.open(width)
        url = Path(path).resolve().as_uri()
        self.events.clear()
        self.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired")
        time.sleep(0.3)  # let late requests, if any, show up
        measured = json.loads(self.send("Runtime.evaluate", {"expression": _MEASURE, "returnByValue": True})
                              ["result"]["value"])
        if screenshot is not None:
            height = min(int(measured["height"]), 16000)
            self.send("Emulation.setDeviceMetricsOverride",
                      {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
            time.sleep(0.2)
            shot = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
            Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
        # drain what is left (events sent while we measured)
        self.send("Runtime.evaluate", {"expression": "1"})
        requests = [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]
        errors = [e["params"]["exceptionDetails"].get("exception", {}).get("description")
                  or e["params"]["exceptionDetails"].get("text")
                  for e in self.events if e.get("method") == "Runtime.exceptionThrown"]
        errors += [e["params"]["entry"]["text"] for e in self.events
                   if e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error"]
        errors += [" ".join(str(a.get("value", a.get("description", ""))) for a in e["params"]["args"])
                   for e in self.events
                   if e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert")]
        return {"url": url, "requests": requests, "errors": errors, **measured}


def load(path: Path, screenshot: Optional[Path] = None, executable: Optional[str] = None,
         width: int = 1400) -> Dict[str, Any]:
    exe = executable or find_chromium()
    if exe is None:
        raise FileNotFoundError("no chromium on PATH (bash scripts/install-chromium.sh)")
    browser = Browser(exe)
    try:
        return browser.load(path, screenshot, width)
    finally:
        browser.close()


if __name__ == "__main__":  # pragma: no cover
    result = load(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None,
                  width=int(sys.argv[3]) if len(sys.argv) > 3 else 1400)
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
