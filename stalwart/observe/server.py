"""``stalwart dashboard``: serves the page and a JSON API over a run directory or a directory of runs.

Endpoints (``run`` is a run id from ``/api/runs``; it may be left out when there is one run):

- ``/``: the page (self-contained: the charting library is inlined, nothing is fetched elsewhere)
- ``/api/runs``: the runs found under the root, or a ``message`` saying why there are none
- ``/api/series?run=ID[&since=STEP&gen=G][&points=N]``: the curves, LTTB-downsampled to N points per
  field; with ``since`` and a current ``gen``, only the steps after ``since`` (the live refresh)
- ``/api/run?run=ID``: everything else the page shows for one run (heat map, stragglers, goodput,
  events, flight recorder, profiler traces), without the per-step curves; ``/api/<part>`` one part
- ``/trace.json?run=ID&first=A&last=B``: a Perfetto trace of those steps
- ``/profile?run=ID&name=FILE``: one of the run's profiler outputs

Bound to 127.0.0.1 by default. Files are re-read on request: the curves incrementally (only appended
bytes), the rest at most every few seconds (``PanelCache``).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlparse

from stalwart.observe.aggregate import load_timings
from stalwart.observe.page import render_page
from stalwart.observe.profiler import list_profiles
from stalwart.observe.reader import load_run, panels, to_json
from stalwart.observe.series import SeriesCache, find_runs
from stalwart.observe.trace import build_trace
from stalwart.paths import RunPaths

DEFAULT_POINTS = 2000


class PanelCache:
    """Recomputes a run's panels at most every ``max(min_age_s, 4 x the last computation)``: a live
    run with a million logged steps costs seconds per read, and the page polls every few seconds."""

    def __init__(self, min_age_s: float = 2.0) -> None:
        self.min_age_s = min_age_s
        self._done: dict[str, tuple[float, float, bytes]] = {}
        self._lock = threading.Lock()

    def get(self, run_id: str, run_dir: Path) -> bytes:
        with self._lock:
            hit = self._done.get(run_id)
            now = time.monotonic()
            if hit and now - hit[0] < max(self.min_age_s, 4 * hit[1]):
                return hit[2]
            t0 = time.monotonic()
            href = "profile?run=" + quote(run_id) + "&name={name}"
            body = to_json(panels(load_run(run_dir), run_dir, href)).encode()
            self._done[run_id] = (now, time.monotonic() - t0, body)
            return body


def _no_runs_message(root: Path) -> str:
    if not root.is_dir():
        return f"{root} is not a directory"
    return (f"No run in {root}: a run directory holds metrics.jsonl, events.jsonl or config.toml. "
            f"Start one with `stalwart train --run.dir {root}/NAME`, or point the dashboard at a run directory "
            "or at the directory that holds them.")


def make_server(root: str | Path, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    root = Path(root)
    page = render_page(root.resolve().name).encode()
    series, panel_cache = SeriesCache(), PanelCache()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, message: str) -> None:
            self._send(code, json.dumps({"error": message}).encode())

        def _run(self, q: dict[str, list[str]]) -> tuple[str, Path] | None:
            runs = find_runs(root)
            rid = q.get("run", [None])[0]
            if rid is None and len(runs) == 1:
                rid = next(iter(runs))
            if rid not in runs:
                self._error(404, f"no run {rid!r} under {root} (see /api/runs)" if rid else
                            "several runs: name one with ?run=ID (see /api/runs)")
                return None
            return rid, runs[rid]

        def _ints(self, q: dict[str, list[str]], *names: str) -> list[int | None] | None:
            try:
                return [int(q[n][0]) if n in q else None for n in names]
            except ValueError:
                self._error(400, f"{', '.join(names)} must be integers")
                return None

        def do_GET(self) -> None:  # noqa: N802
            url = urlparse(self.path)
            path, q = url.path.rstrip("/") or "/", parse_qs(url.query)
            try:
                self._route(path, q)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _route(self, path: str, q: dict[str, list[str]]) -> None:
            if path in ("/", "/index.html"):
                return self._send(200, page, "text/html; charset=utf-8")
            if path == "/favicon.ico":
                return self._send(204, b"", "image/x-icon")
            if path == "/api/runs":
                runs = find_runs(root)
                body = {"root": str(root), "runs": [{"id": k, "path": str(v)} for k, v in runs.items()],
                        "message": None if runs else _no_runs_message(root)}
                return self._send(200, json.dumps(body).encode())
            found = self._run(q) if path.startswith("/api/") or path in ("/trace.json", "/profile") else None
            if found is None:
                return None if path.startswith("/api/") or path in ("/trace.json", "/profile") else \
                    self._send(404, b"not found", "text/plain")
            rid, run_dir = found
            if path == "/api/series":
                ints = self._ints(q, "since", "gen", "points")
                if ints is None:
                    return None
                since, gen, points = ints
                res = series.get(run_dir).query(since, gen, max(3, min(points or DEFAULT_POINTS, 20000)))
                return self._send(200, to_json({"run": rid, **res}).encode())
            if path == "/trace.json":
                ints = self._ints(q, "first", "last")
                if ints is None:
                    return None
                return self._send(200, json.dumps(build_trace(load_timings(run_dir), *ints)).encode())
            if path == "/profile":
                name = q.get("name", [""])[0]
                known = {p["name"] for p in list_profiles(RunPaths(run_dir))}
                if name not in known:
                    return self._error(404, f"no profiler output {name!r} in run {rid}")
                return self._send(200, (RunPaths(run_dir).profile_dir / name).read_bytes(),
                                  "application/octet-stream")
            body = panel_cache.get(rid, run_dir)
            part = path[len("/api/"):]
            if part == "run":
                return self._send(200, body)
            data = json.loads(body)
            if part in data:
                return self._send(200, to_json({part: data[part]}).encode())
            return self._error(404, "unknown part")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve_in_thread(root: str | Path, host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """Start a dashboard in a daemon thread (tests, notebooks); returns the server and its URL."""
    server = make_server(root, host, port)
    threading.Thread(target=server.serve_forever, name="stalwart-dashboard", daemon=True).start()
    h, p = server.server_address[:2]
    return server, f"http://{h}:{p}/"
