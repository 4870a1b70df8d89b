"""An in-process OpenAI-compatible server over a given engine: the real app and engine thread behind
uvicorn on a loopback port, spoken to with OpenAI's client (for module-scoped fixtures)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import openai
import uvicorn

from stalwart.infer.engine import Engine
from stalwart.serve.app import create_app
from stalwart.serve.http import bind
from stalwart.serve.loop import EngineLoop


@contextlib.contextmanager
def serve_app(app) -> Iterator[str]:
    """The base URL of ``app`` served by uvicorn on a loopback port, on a thread, until the block ends."""
    sock = bind("127.0.0.1", 0)
    sock.listen()
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not http.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        http.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def serve_in_process(engine: Engine, model_name: str = "tiny") -> Iterator[tuple[str, openai.OpenAI]]:
    """(base URL, OpenAI client) of a server running ``engine`` until the block ends."""
    loop = EngineLoop(engine).start()
    try:
        with serve_app(create_app(loop, model_name)) as url:
            yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        loop.stop()
