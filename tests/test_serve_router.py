"""The router's supervision with stand-in replicas (small processes answering /health as told): a replica
whose /health stays 503 is killed and started again, one whose process exits is started again, and
each rejoins on the port it then writes. The router with real replicas is in
test_serve_migration_e2e.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from stalwart.serve import fleet as replica_fleet
from stalwart.serve.fleet import Fleet
from stalwart.serve.router import create_router

from inproc_server import serve_app

pytestmark = pytest.mark.unit

# A replica stand-in: serves /health with the status in its status file, writes its port once serving.
STANDIN = """
import http.server, sys
status_file, port_file = sys.argv[1], sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = int(open(status_file).read())
        self.send_response(code); self.send_header("content-type", "application/json"); self.end_headers()
        self.wfile.write(b'{"status": "ok"}' if code == 200 else b'{"error": "the engine is stuck"}')
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
open(port_file + ".tmp", "w").write(str(s.server_port)); __import__("os").replace(port_file + ".tmp", port_file)
s.serve_forever()
"""


def test_a_failing_replica_is_killed_and_started_again_and_rejoins(tmp_path, monkeypatch):
    monkeypatch.setattr(replica_fleet, "RESTART_AFTER_S", 1.0)
    monkeypatch.setattr(replica_fleet, "PROBE_INTERVAL_S", 0.2)
    status = [tmp_path / f"status-{i}" for i in range(2)]
    files = [tmp_path / f"port-{i}" for i in range(2)]
    for f in status:
        f.write_text("200")

    def start(i: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", STANDIN, str(status[i]), str(files[i])], process_group=0)

    procs = [start(i) for i in range(2)]
    try:
        while not all(f.is_file() for f in files):
            time.sleep(0.05)
        backends = [f"http://127.0.0.1:{int(f.read_text())}" for f in files]
        fleet = Fleet(procs, files, start)
        with serve_app(create_router(backends, fleet)) as url:

            def health() -> list[dict]:
                return httpx.get(url + "/health", timeout=10).json()["replicas"]

            def wait(what, timeout: float = 20.0) -> list[dict]:
                deadline = time.monotonic() + timeout
                while not what(h := health()):
                    assert time.monotonic() < deadline, h
                    time.sleep(0.1)
                return h

            first = procs[0]
            status[0].write_text("503")  # replica 0's engine is stuck: killed and started again
            h = wait(lambda h: h[0]["restarts"] == 1)
            assert first.wait(10) < 0 and fleet.procs[0] is not first
            status[0].write_text("200")
            h = wait(lambda h: h[0]["ok"] and h[1]["ok"])
            fleet.procs[1].kill()  # replica 1's process exits: started again
            h = wait(lambda h: h[1]["restarts"] == 1 and h[1]["ok"])
            assert [r["restarts"] for r in h] == [1, 1]
    finally:
        for p in fleet.procs if "fleet" in locals() else procs:
            p.kill()
            p.wait()
