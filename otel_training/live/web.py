"""``otel-training top --web HOST:PORT``: the live run as the HTML report's page
(report/page.py: the same charts, findings and text), served on loopback and reloaded
by the browser every few seconds. The page loads nothing else (its Content-Security-
Policy is the report's)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from otel_training.report.page import build_html
from otel_training.report.sources import ReportError

from .report import live_report
from .state import LiveRun

RELOAD_S = 2  # the page asks the browser to reload it this often
_RELOAD = f'<meta http-equiv="refresh" content="{RELOAD_S}">'
_WAITING = (
    "<!doctype html>\n<html lang=en><head><meta charset=utf-8>" + _RELOAD + "<title>otel-training top</title></head>"
    "<body><p>otel-training top: waiting for a job's first export after its first step.</p></body></html>\n"
)


def page(run: LiveRun) -> str:
    """The page now: the report of the run so far, or a note while no step is in."""
    report = live_report(run)
    if not report.modes:
        return _WAITING
    try:
        text = build_html([report])
    except ReportError:  # no windows yet
        return _WAITING
    return text.replace("<head>", "<head>" + _RELOAD, 1)


class WebView:
    """An HTTP server on ``address`` (``host:port``; port 0: any free one) serving :func:`page`."""

    def __init__(self, run: LiveRun, address: str) -> None:
        host, _, port = address.rpartition(":")
        view = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] not in ("/", "/index.html"):
                    self.send_error(404)
                    return
                try:
                    body = page(view.run).encode()
                except Exception as exc:  # the viewer's bug: the page says so, the view goes on
                    body = f"<!doctype html><p>otel-training top: {type(exc).__name__}: {exc}</p>".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                return  # the terminal belongs to the view

        self.run = run
        self._server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.host = host or "127.0.0.1"
        threading.Thread(target=self._server.serve_forever, name="otel-training-top-web", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
