"""``stalwart dashboard``: serves the page and a JSON API, re-reading the run directory per request.

Endpoints: ``/`` (the page), ``/api/run`` (everything the page shows), ``/api/<part>`` for one part
(``train``, ``eval``, ``events``, ``heatmaps``, ``stragglers``, ``goodput``, ``summary``, ``flight``),
``/trace.json?first=A&last=B`` (a Perfetto trace of those steps). Bound to 127.0.0.1 by default.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from stalwart.observe.aggregate import load_timings
from stalwart.observe.page import render_page
from stalwart.observe.reader import load_run, to_json
from stalwart.observe.trace import build_trace


def make_server(run_dir: str | Path, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    run_dir = Path(run_dir)
    page = render_page(run_dir.name).encode()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            url = urlparse(self.path)
            path = url.path.rstrip("/") or "/"
            try:
                if path in ("/", "/index.html"):
                    self._send(200, page, "text/html; charset=utf-8")
                elif path == "/favicon.ico":
                    self._send(204, b"", "image/x-icon")
                elif path == "/trace.json":
                    q = parse_qs(url.query)
                    try:
                        first = int(q["first"][0]) if "first" in q else None
                        last = int(q["last"][0]) if "last" in q else None
                    except ValueError:
                        self._send(400, b'{"error": "first and last must be step numbers (integers)"}',
                                   "application/json")
                        return
                    body = json.dumps(build_trace(load_timings(run_dir), first, last)).encode()
                    self._send(200, body, "application/json")
                elif path.startswith("/api/"):
                    data = load_run(run_dir)
                    part = path[len("/api/"):]
                    if part == "run":
                        self._send(200, to_json(data).encode(), "application/json")
                    elif part in data:
                        self._send(200, to_json({part: data[part]}).encode(), "application/json")
                    else:
                        self._send(404, b'{"error": "unknown part"}', "application/json")
                else:
                    self._send(404, b"not found", "text/plain")
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve_in_thread(run_dir: str | Path, host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """Start a dashboard in a daemon thread (tests, notebooks); returns the server and its URL."""
    server = make_server(run_dir, host, port)
    threading.Thread(target=server.serve_forever, name="stalwart-dashboard", daemon=True).start()
    h, p = server.server_address[:2]
    return server, f"http://{h}:{p}/"
