"""Serving's HTTP side: the server a replica or the router runs (``stalwart.asgi`` underneath) and the
abort of a request whose client left."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

from stalwart.asgi import bind, run
from stalwart.atomic import write_text_atomic

__all__ = ["ClientGone", "bind", "serve", "unless_client_leaves"]

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


def serve(app, host: str, port: int, what: str, port_file: Path | None = None, sock=None,
          on_serving: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (a graceful shutdown; a stop asked for is exit status 0), on ``sock``
    when given (bound already: a replica's launcher holds it), else on ``host:port``. ``on_serving()``
    runs once connections are accepted."""
    shown = f"[{host}]" if ":" in host else host

    def listening(actual: int) -> None:
        print(f"stalwart serve: {what} on http://{shown}:{actual}/v1", flush=True)
        if port_file is not None:
            write_text_atomic(port_file, str(actual))
        if on_serving is not None:
            on_serving()

    run(app, sock if sock is not None else bind(host, port), 5, listening)
    print("stalwart serve: stopped", flush=True)
