"""Run an ASGI app with uvicorn on a socket we bind ourselves (so port 0 works and is reported)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
from pathlib import Path
from typing import Awaitable, TypeVar

import uvicorn

from stalwart.atomic import write_text_atomic
from stalwart.errors import UserError


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port; a UserError naming server.host or server.port says which is wrong."""
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
            raise UserError(f"server.host: cannot listen on {host} ({why}); give an address of this machine "
                            "with --host, e.g. 127.0.0.1 or 0.0.0.0") from None
        raise UserError(f"server.port: cannot listen on {host}:{port} ({why}); choose another --port") from None
    return sock


T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def unless_client_leaves(request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client of ``request`` (a Starlette request whose body was read)
    disconnects first: then ``work`` is cancelled and ClientGone raised, so its caller can free what the
    request holds. A handler that answers at the end (no stream) learns of a departed client only so."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # its outcome no longer matters
        await task
    raise ClientGone()


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, for which every SIGINT/SIGTERM asks for the graceful shutdown (bounded by
    ``timeout_graceful_shutdown``). uvicorn's own forces an exit on a SIGINT after another signal, which
    cancels the app's lifespan with a traceback; in a tensor-parallel group one stop can reach rank 0
    more than once (from the terminal, the launcher, the command), and all of them mean the same."""

    def handle_exit(self, sig: int, frame) -> None:
        self.should_exit = True


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
    server = _GracefulServer(config)
    # Also before uvicorn listens to the signals (a stop asked for during its start-up stops it) and after
    # (a stop during its shutdown changes nothing). A stop asked for is exit status 0.
    previous = {s: signal.signal(s, server.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("stalwart serve: stopped", flush=True)
