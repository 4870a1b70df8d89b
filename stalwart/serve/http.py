"""Run an ASGI app with uvicorn on a socket we bind ourselves (so port 0 works and is reported)."""

from __future__ import annotations

import errno
import signal
import socket
from pathlib import Path

import uvicorn

from stalwart.atomic import write_text_atomic
from stalwart.errors import UserError


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port; a UserError naming server.host or server.port says which is wrong."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = e.strerror or str(e)
        # A name that does not resolve, or an address this machine does not have, is the host's fault.
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"server.host: cannot listen on {host} ({why}); give an address of this machine "
                            "with --host, e.g. 127.0.0.1 or 0.0.0.0") from None
        raise UserError(f"server.port: cannot listen on {host}:{port} ({why}); choose another --port") from None
    return sock


def serve(app, host: str, port: int, what: str, port_file: Path | None = None) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn handles both and shuts down gracefully)."""
    sock = bind(host, port)
    sock.listen(2048)  # connections from now on wait for uvicorn rather than being refused
    actual = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"stalwart serve: {what} on http://{shown}:{actual}/v1", flush=True)
    if port_file is not None:
        write_text_atomic(port_file, str(actual))
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler that was
    # installed before it: make that a no-op, so a requested shutdown ends with exit status 0.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("stalwart serve: stopped", flush=True)
