"""The answer on a replica's HTTP socket while no rank 0 serves on it: 503 with ``Retry-After``.

A replica's launcher (serve/launcher.py) binds the socket and keeps it for the replica's life; rank 0,
a fork of the launcher, serves the API on it. From the launcher's start until rank 0 accepts, and from
rank 0's loss until the rank started again accepts, the launcher itself answers every request on the
same socket: ``/health`` with ``{"status": "starting"|"recovering", ...}``, anything else with OpenAI's
error body, both 503 and ``Retry-After``, so a client or load balancer sees a replica that is coming
back instead of a refused connection. stdlib's threading HTTP server (a thread per connection, each
with a timeout: no client can hold it), on the shared socket, which it never closes.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RETRY_AFTER_S = 1
CLIENT_TIMEOUT_S = 5.0  # a connection that sends no complete request within this is closed


class _Handler(BaseHTTPRequestHandler):
    timeout = CLIENT_TIMEOUT_S
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        status, model = self.server.status, self.server.model
        why = self.server.why
        if self.path.split("?")[0] == "/health":
            body = {"status": status, "model": model, "error": why}
        else:
            body = {"error": {"message": f"{why}; retry in {RETRY_AFTER_S} s", "type": "server_error",
                              "param": None, "code": None}}
        data = json.dumps(body).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Retry-After", str(RETRY_AFTER_S))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _answer

    def log_message(self, *args) -> None:  # quiet, as the API's server is
        pass


class _SharedSocketServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()  # the one the base class made: serve on the shared one instead
        self.socket = sock
        self.status, self.model, self.why = "starting", "", ""

    def server_close(self) -> None:  # the socket is rank 0's too: never closed here
        pass


class Standby:
    """Answers on ``sock`` from ``start(...)`` to ``stop()``, from a thread of its own."""

    def __init__(self, sock: socket.socket, model: str) -> None:
        self.server = _SharedSocketServer(sock)
        self.server.model = model
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()  # started by the supervising thread, stopped by a watching one

    @property
    def active(self) -> bool:
        return self.thread is not None

    def start(self, status: str, why: str) -> None:
        with self._lock:
            self.server.status, self.server.why = status, why
            if self.thread is None:
                self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                               name="stalwart-standby", daemon=True)
                self.thread.start()

    def stop(self) -> None:
        with self._lock:
            if self.thread is not None:
                self.server.shutdown()
                self.thread.join()
                self.thread = None
