"""Run an ASGI app with uvicorn on a socket we bind ourselves: port 0 works and the real port is known,
errors name the setting to fix, and every SIGINT/SIGTERM is the graceful stop. Used by `stalwart serve`
(its replicas and router) and by the RL sandbox service."""

from __future__ import annotations

import errno
import signal
import socket
from collections.abc import Callable

import uvicorn

from stalwart.errors import UserError


def bind(host: str, port: int, host_setting: tuple[str, str] = ("server.host", "--host"),
         port_setting: tuple[str, str] = ("server.port", "--port")) -> socket.socket:
    """A socket bound to host:port; a UserError naming the setting (and its flag) that is wrong."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets it sees as TCP, and without it every
    # answer on a kept-alive connection waits for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = e.strerror or str(e)
        # A name that does not resolve, or an address this machine does not have, is the host's fault.
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"{host_setting[0]}: cannot listen on {host} ({why}); give an address of this machine "
                            f"with {host_setting[1]}, e.g. 127.0.0.1 or 0.0.0.0") from None
        raise UserError(f"{port_setting[0]}: cannot listen on {host}:{port} ({why}); choose another "
                        f"{port_setting[1]}") from None
    return sock


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, for which every SIGINT/SIGTERM asks for the graceful shutdown (bounded by
    ``timeout_graceful_shutdown``). uvicorn's own forces an exit on a SIGINT after another signal, which
    cancels the app's lifespan with a traceback; in a tensor-parallel group one stop can reach rank 0
    more than once (from the terminal, the launcher, the command), and all of them mean the same."""

    def handle_exit(self, sig: int, frame) -> None:
        self.should_exit = True


def run(app, sock: socket.socket, grace_s: float, on_listening: Callable[[int], None] | None = None) -> None:
    """Serve ``app`` on the bound ``sock`` until SIGINT/SIGTERM (a stop asked for is exit status 0);
    ``on_listening(port)`` runs once connections queue for uvicorn."""
    sock.listen(2048)  # connections from now on wait for uvicorn rather than being refused
    if on_listening is not None:
        on_listening(sock.getsockname()[1])
    server = _GracefulServer(uvicorn.Config(app, log_level="warning", access_log=False,
                                            timeout_graceful_shutdown=grace_s))
    # Also before uvicorn listens to the signals (a stop asked for during its start-up stops it) and after
    # (a stop during its shutdown changes nothing).
    previous = {s: signal.signal(s, server.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
