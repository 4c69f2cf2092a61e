"""The coordinator's read-only web dashboard, its JSON API and its Prometheus ``/metrics``.

``GET /`` is the page (Plotly, served from the installed ``plotly`` package: nothing is fetched
from the internet), ``GET /api/status`` the snapshot it polls (also what ``dipaco status``
reads), ``GET /metrics`` the Prometheus text format. Anything but GET and HEAD is refused.

Bound to loopback it is open; bound to any other address it wants a token, either as
``?token=...`` (the page passes it on) or as ``Authorization: Bearer ...``. Refusals are counted
(``dipaco_dashboard_refused_total``).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dipaco.errors import ConfigError
from dipaco.fileio import write_atomic, write_private
from dipaco.watch.snapshot import LastState, Series, json_safe, snapshot

log = logging.getLogger(__name__)


def _plotly_js() -> bytes:
    import plotly

    return (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RunCollector:
    """Prometheus metrics made from the snapshot at scrape time."""

    def __init__(self, dashboard: Dashboard) -> None:
        self.dashboard = dashboard

    def collect(self):
        s = self.dashboard.snapshot()
        yield GaugeMetricFamily("dipaco_round", "Current outer round of the run", s["round"])
        yield GaugeMetricFamily("dipaco_rounds", "Outer rounds the run will train", s["rounds"])
        g = GaugeMetricFamily("dipaco_finished", "1 once every module reached its last round")
        g.add_metric([], 1 if s["finished"] else 0)
        yield g
        g = GaugeMetricFamily("dipaco_module_version", "Outer steps applied", labels=["module"])
        p = GaugeMetricFamily("dipaco_module_pending", "Deltas waiting", labels=["module"])
        for mid, info in sorted(s["modules"].items()):
            g.add_metric([mid], info.get("version", 0))
            p.add_metric([mid], len(info.get("pending", [])))
        yield g
        yield p
        yield GaugeMetricFamily(
            "dipaco_peers", "Peers the coordinator has heard from", len(s["peers"])
        )
        yield GaugeMetricFamily("dipaco_leases", "Tasks out with peers", len(s["leases"]))
        seen = GaugeMetricFamily(
            "dipaco_peer_seen_seconds", "Since a peer's last request", labels=["peer"]
        )
        rate = GaugeMetricFamily(
            "dipaco_peer_tokens_per_second", "Last task's rate", labels=["peer"]
        )
        done = CounterMetricFamily("dipaco_peer_tasks", "Tasks a peer completed", labels=["peer"])
        moved = CounterMetricFamily(
            "dipaco_peer_bytes", "Bytes to and from a peer", labels=["peer", "direction"]
        )
        for pid, info in sorted(s["peers"].items()):
            seen.add_metric([pid], info.get("seen_ago", 0))
            rate.add_metric([pid], info.get("tokens_per_s", 0))
            done.add_metric([pid], info.get("tasks_done", 0))
            moved.add_metric([pid, "in"], info.get("bytes_in", 0))
            moved.add_metric([pid, "out"], info.get("bytes_out", 0))
        yield from (seen, rate, done, moved)
        c = CounterMetricFamily("dipaco_rejections", "Requests refused", labels=["reason"])
        for reason, n in sorted(s["rejections"].items()):
            c.add_metric([reason], n)
        yield c
        routed = s["series"]["routed_ppl"]
        if routed:
            g = GaugeMetricFamily("dipaco_validation_ppl", "Routed validation perplexity")
            g.add_metric([], routed[-1]["ppl"])
            yield g
        refused = self.dashboard.refused
        yield CounterMetricFamily("dipaco_dashboard_refused", "Dashboard requests refused", refused)


class Dashboard:
    """Serve the dashboard for ``coordinator`` on ``host:port`` (port 0 picks one)."""

    def __init__(
        self,
        coordinator,
        run_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.run_dir = Path(run_dir)
        self.series = Series(self.run_dir / "metrics.jsonl")
        self.last = LastState()  # what a snapshot shows while the coordinator is busy
        self.refused = 0
        self.token = token
        if self.token is None and not is_loopback(host):
            self.token = secrets.token_urlsafe(18)
        if self.token is not None:
            write_private(self.run_dir / "coordinator" / "dashboard.token", self.token + "\n")
        self.registry = CollectorRegistry()
        self.registry.register(RunCollector(self))
        self._page = resources.files("dipaco.watch").joinpath("dashboard.html").read_bytes()
        self._plotly: bytes | None = None
        try:
            self.server = ThreadingHTTPServer((host, port), self._handler())
        except OSError as exc:
            raise ConfigError(f"the dashboard cannot listen on {host}:{port}: {exc}") from exc
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        url = f"http://{host}:{port}/"
        return url + (f"?token={self.token}" if self.token else "")

    def start(self) -> Dashboard:
        self.thread.start()
        return self

    def stop(self) -> Path | None:
        """Stop serving, and keep the last state viewable: ``<run-dir>/dashboard/index.html``
        (the page with its last snapshot inside, Plotly beside it) and ``status.json`` (what
        ``dipaco status RUN_DIR`` reads). Returns the page's path, or None if it could not be
        written."""
        self.server.shutdown()
        self.server.server_close()
        try:
            return self.save(self.run_dir / "dashboard")
        except OSError as exc:
            log.warning("cannot save the dashboard's final state: %s", exc)
            return None

    def save(self, folder: Path) -> Path:
        data = json.dumps(json_safe(self.snapshot()), allow_nan=False)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / "status.json", data.encode())
        plotly = folder / "plotly.min.js"
        if not plotly.exists():
            write_atomic(plotly, self.plotly())
        embedded = data.replace("</", "<\\/")  # nothing in the data can close the script
        page = self._page.replace(
            b'<script src="/static/plotly.min.js"></script>',
            b'<script src="plotly.min.js"></script>\n<script>window.DIPACO_STATUS = '
            + embedded.encode()
            + b";</script>",
        )
        write_atomic(folder / "index.html", page)
        return folder / "index.html"

    def snapshot(self) -> dict:
        return snapshot(self.coordinator, self.run_dir, self.series, self.last)

    def plotly(self) -> bytes:
        if self._plotly is None:
            self._plotly = _plotly_js()
        return self._plotly

    def allowed(self, handler: BaseHTTPRequestHandler) -> bool:
        if self.token is None:
            return True
        query = parse_qs(urlsplit(handler.path).query)
        offered = query.get("token", [""])[0]
        bearer = handler.headers.get("Authorization", "")
        if bearer.startswith("Bearer "):
            offered = bearer[len("Bearer ") :]
        return hmac.compare_digest(offered.encode(), self.token.encode())

    def _handler(self):
        dashboard = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "dipaco-dashboard"

            def log_message(self, fmt, *args):  # quiet: the coordinator's log is for the run
                log.debug("dashboard: " + fmt, *args)

            def _send(self, code: int, body: bytes, ctype: str, cache: bool = False) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "max-age=86400" if cache else "no-store")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                route = urlsplit(self.path).path
                if route == "/static/plotly.min.js":  # a public library: no token needed
                    return self._send(200, dashboard.plotly(), "text/javascript", cache=True)
                if not dashboard.allowed(self):
                    dashboard.refused += 1
                    return self._send(401, b"a token is needed: ?token=...\n", "text/plain")
                if route == "/":
                    return self._send(200, dashboard._page, "text/html; charset=utf-8")
                if route == "/api/status":
                    body = json.dumps(json_safe(dashboard.snapshot()), allow_nan=False).encode()
                    return self._send(200, body, "application/json")
                if route == "/metrics":
                    body = generate_latest(dashboard.registry)
                    return self._send(200, body, "text/plain; version=0.0.4")
                return self._send(404, b"not found\n", "text/plain")

            do_HEAD = do_GET  # noqa: N815

            def _read_only(self) -> None:
                dashboard.refused += 1
                self._send(405, b"the dashboard is read-only\n", "text/plain")

            do_POST = do_PUT = do_DELETE = do_PATCH = _read_only  # noqa: N815

        return Handler
