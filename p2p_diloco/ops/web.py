"""``p2p-diloco web``: the run page, a web page and a JSON API over a live run's DHT records.

A client-mode DHT node (as ``p2p-diloco status``: it stores nothing for others and is never in a group) reads the
run every ``refresh_s`` seconds on a background thread, through ops/status.py's reader (the run index, each
prefix's roster) and net/keys.py's run settings reader, into a cache: JSON encoded once per read. HTTP requests
(the standard library's ThreadingHTTPServer) serve that cache and the page's files, which ship in the package
(``web_assets/``: no CDN, works offline). What is shown is typed and bounded by ops/web_view.py; the page renders it
as text only, under a Content-Security-Policy that allows no inline script and no other origin.

Paths: ``/`` the page, ``/app.js``, ``/style.css``, ``/api/run`` the run (web_view.page_view).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Callable, Optional

from p2p_diloco.config import Config, ConfigError
from p2p_diloco.ops import web_view
from p2p_diloco.ops.status import read_status

logger = logging.getLogger(__name__)

ASSETS = {"/": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/style.css": ("style.css", "text/css; charset=utf-8")}
HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           # no inline script or style, nothing from elsewhere: record text can never run as code on this page
           "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                      "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
                                      "frame-ancestors 'none'"}


class RunWatcher:
    """Reads the run from the DHT into a cache of JSON bytes (:meth:`body`); remembers the rounds it saw and, for
    ``web_view.GONE_KEEP_S`` seconds, the peers whose roster entry expired."""

    def __init__(self, dht, run_id: str, refresh_s: float, timeout: float, clock: Callable[[], float] = time.time):
        self.dht, self.run_id, self.refresh_s, self.timeout, self.clock = dht, run_id, refresh_s, timeout, clock
        self.history = web_view.RoundHistory()
        self.seen: dict[tuple[str, str], tuple[float, dict]] = {}  # (prefix, peer id) → (last seen, its row)
        self.reads = 0
        self._runs: list[dict] = []
        self._settings: dict = {}
        self._read_at: Optional[float] = None
        self._last_error: Optional[str] = None
        self._lock = threading.Lock()
        self._body = self._encode(error="not read yet")

    def body(self) -> bytes:
        with self._lock:
            return self._body

    def loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.refresh()
            if stop.wait(self.refresh_s):
                return

    def refresh(self) -> None:
        """One read of the run. A failed read keeps the last view and says why on the page; it never raises."""
        from p2p_diloco.net.keys import read_run_settings
        from p2p_diloco.net.run_settings import run_settings_of

        try:
            view = read_status(self.dht, self.run_id, self.timeout)
            settings = run_settings_of(read_run_settings(self.dht, self.run_id, self.timeout))
        except Exception as e:  # a dead DHT must not end the page: it shows the error
            self.show(None, None, error=f"reading the run failed: {type(e).__name__}: {e}")
        else:
            self.show(view, settings)

    def show(self, view: Optional[dict], settings: Optional[dict], error: Optional[str] = None) -> None:
        """Cache a view of the run (ops/status.py's ``read_status``) and its settings (``run_settings_of``); None:
        keep the last ones, with ``error`` on the page."""
        if view is not None:
            try:
                now = self.clock()
                self._runs = self.update(view["runs"], now)
                self._settings, self._read_at = web_view.bounded_settings(settings), now
            except Exception as e:  # a record the readers let through but the page cannot show: say so, go on
                error = f"showing the run failed: {type(e).__name__}: {e}"
        if error and error != self._last_error:  # once per kind of failure, not every few seconds
            logger.warning(error)
        self._last_error = error
        self.reads += 1
        body = self._encode(error)
        with self._lock:
            self._body = body

    def update(self, runs: list[dict], now: float) -> list[dict]:
        """ops/status.py's prefixes (``describe_run``) → the page's, bounded; notes who was seen and which rounds."""
        out = []
        self.seen = {k: v for k, v in self.seen.items() if now - v[0] < web_view.GONE_KEEP_S}
        for run in runs[:web_view.MAX_PREFIXES]:
            prefix = run["prefix"]
            rows = [web_view.peer_row(p, now) for p in run["peers"]]
            for row in rows:
                self.seen[(prefix, row["peer_id"])] = (now, row)
            self.history.observe(prefix, rows)
            live = {row["peer_id"] for row in rows}
            gone = sorted((dict(row, last_seen=t, state="gone") for (pre, pid), (t, row) in self.seen.items()
                           if pre == prefix and pid not in live), key=lambda r: -r["last_seen"])
            out.append(web_view.run_view({**run, "peers": rows}, gone, self.history))
        self._forget({run["prefix"] for run in runs[:web_view.MAX_PREFIXES]})
        return out

    def _forget(self, prefixes: set[str]) -> None:
        if len(self.seen) > web_view.MAX_TRACKED:  # a forged roster: keep the most recently seen
            latest = sorted(self.seen.items(), key=lambda kv: -kv[1][0])[:web_view.MAX_TRACKED]
            self.seen = dict(latest)
        if prefixes:  # an empty read (the DHT did not answer) forgets no round
            self.history.forget(prefixes)

    def _encode(self, error: Optional[str]) -> bytes:
        view = web_view.page_view(self.run_id, self._runs, self._settings, self._read_at, self.clock(), error,
                                  self.refresh_s)
        return json.dumps(view, allow_nan=False).encode()


# ---------------------------------------------------------------------------------------------- the server

def load_assets() -> dict[str, tuple[bytes, str]]:
    """URL path → (the file's bytes, its content type), read once from the package."""
    folder = resources.files("p2p_diloco.ops") / "web_assets"
    return {path: ((folder / name).read_bytes(), ctype) for path, (name, ctype) in ASSETS.items()}


class RunPageServer(ThreadingHTTPServer):
    daemon_threads = True  # a slow client never holds the stop up

    def __init__(self, address: tuple[str, int], source: Callable[[], bytes]):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.source, self.assets = source, load_assets()
        super().__init__(address, RunPageHandler)


class RunPageHandler(BaseHTTPRequestHandler):
    server: RunPageServer
    server_version = "p2p-diloco-web"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/api/run":
            self._send(200, self.server.source(), "application/json")
        elif path == "/favicon.ico":  # the page has none: an empty answer, not a 404 in the browser's console
            self._send(204, b"", "text/plain")
        elif path in self.server.assets:
            self._send(200, *self.server.assets[path])
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for name, value in HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the standard library's name)
        logger.debug(f"{self.address_string()} {format % args}")


def open_server(host: str, port: int, source: Callable[[], bytes]) -> RunPageServer:
    """Bind the page's address, or raise ConfigError (one line): a taken port, a host that is not ours."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port: must be in 0..65535, got {port}")
    try:
        return RunPageServer((host, port), source)
    except OSError as e:
        raise ConfigError(f"web: cannot listen on {host}:{port}: {e.strerror or e}") from None


def page_url(server: RunPageServer) -> str:
    host, port = server.server_address[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


# ---------------------------------------------------------------------------------------------- the command

def run_web(cfg: Config, host: str, port: int, refresh_s: float, stop: threading.Event,
            echo: Callable[[str], None] = print) -> int:
    """Serve the run page until ``stop`` is set. The address is bound before the DHT starts, so a taken port is
    refused at once."""
    box: dict[str, Callable[[], bytes]] = {}
    server = open_server(host, port, lambda: box["source"]())
    from p2p_diloco.net.dht import start_dht  # hivemind and torch: seconds, after the cheap checks
    threads: list[threading.Thread] = []
    try:
        dht = start_dht(cfg.network, client_mode=True)
        try:
            watcher = RunWatcher(dht, cfg.run.run_id, refresh_s, cfg.averaging.request_timeout)
            box["source"] = watcher.body
            threads = [threading.Thread(target=watcher.loop, args=(stop,), name="web-reader", daemon=True),
                       threading.Thread(target=server.serve_forever, args=(0.5,), name="web-server", daemon=True)]
            for thread in threads:
                thread.start()
            echo(f"run page of {cfg.run.run_id!r} at {page_url(server)} (JSON: {page_url(server)}api/run); "
                 f"Ctrl-C stops it")
            stop.wait()
        finally:
            if threads:
                server.shutdown()  # serve_forever returns within its poll interval
                threads[0].join(timeout=2 * cfg.averaging.request_timeout + 1)  # a read in flight ends by its timeout
            dht.shutdown()
    finally:
        server.server_close()
    return 0
