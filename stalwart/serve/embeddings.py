"""`stalwart serve` of an embeddings model: OpenAI's ``POST /v1/embeddings``, batched dynamically.

Requests are checked on the event loop (a bad one gets OpenAI's error body and never reaches the model),
encoded, and queued as rows. One thread, the batcher, takes every waiting row in arrival order up to
``embeddings.max_batch_tokens`` (rows x the longest of them, padding included; always at least one
row), runs one forward (``Embedder.embed_tokens``), and hands each request its vectors once all its rows
are done. Texts are encoded exactly as the embedder encodes them for an index (``Embedder.encode``: the
first ``max_tokens - 1`` tokens and the end token), so an over-long text is truncated as in training,
not refused; ``usage`` counts the tokens embedded. Token-id inputs are truncated the same way.

One process, on the host CPU (the embedder's device); no replicas or router for embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel

from stalwart.config.serve import EmbeddingsConfig, ServeConfig
from stalwart.errors import UserError
from stalwart.runtime.device import HOST
from stalwart.serve.errors import ApiError, install_error_handlers
from stalwart.serve.metrics import LATENCY_BUCKETS
from stalwart.serve.protocol import STRICT

STUCK_S = 30.0  # /health says 503 once the batcher has made no progress for this long


class EmbeddingsRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


@dataclass
class Pending:
    """One request's rows and the vectors computed so far; ``future`` gets them all."""

    rows: list[list[int]]
    future: Future
    vectors: np.ndarray | None = None
    done: int = 0
    arrived: float = field(default_factory=time.monotonic)


class EmbeddingsMetrics:
    def __init__(self, model: str) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("stalwart_embeddings_requests", "Requests answered, by outcome.",
                                ["model", "outcome"], registry=r)
        self.model = model
        labels = {"model": model}
        self.inputs = Counter("stalwart_embeddings_inputs", "Texts embedded.", ["model"], registry=r).labels(**labels)
        self.tokens = Counter("stalwart_embeddings_tokens", "Tokens embedded (usage.prompt_tokens).", ["model"],
                              registry=r).labels(**labels)
        self.queued = Gauge("stalwart_embeddings_queued_inputs", "Texts waiting for a forward pass.", ["model"],
                            registry=r).labels(**labels)
        self.batch_rows = Histogram("stalwart_embeddings_batch_rows", "Texts in one forward pass.", ["model"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r).labels(**labels)
        self.forward_seconds = Histogram("stalwart_embeddings_forward_seconds", "One forward pass of the batcher.",
                                         ["model"], buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        self.latency = Histogram("stalwart_embeddings_request_seconds", "From arrival to the last vector.",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r).labels(**labels)

    def outcome(self, name: str) -> None:
        self.requests.labels(model=self.model, outcome=name).inc()


class Batcher:
    """The thread that embeds every waiting request's rows, ``max_batch_tokens`` per forward."""

    def __init__(self, embedder, cfg: EmbeddingsConfig, metrics: EmbeddingsMetrics) -> None:
        self.embedder, self.cfg, self.metrics = embedder, cfg, metrics
        self._queue: deque[Pending] = deque()
        self._queued_rows = 0
        self._cond = threading.Condition()
        self._stopped = False
        self.batches = 0
        self.last_tick = time.monotonic()  # the thread's last sign of life: idle wake-up or forward finished
        self.busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="stalwart-embeddings", daemon=True)

    def start(self) -> Batcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(30)

    def problem(self) -> str | None:
        """Why this server cannot embed now (None: the thread is alive and making progress)."""
        if not self._thread.is_alive():
            return "the embedding thread has stopped"
        now = time.monotonic()
        if self.busy_since is not None and now - self.busy_since > STUCK_S:
            return f"one forward pass has run for {now - self.busy_since:.0f} s"
        if self.busy_since is None and now - self.last_tick > STUCK_S:
            return f"the embedding thread has not woken for {now - self.last_tick:.0f} s"
        return None

    def submit(self, rows: list[list[int]]) -> Future:
        future: Future = Future()
        with self._cond:
            if self._queued_rows + len(rows) > self.cfg.max_queue:
                raise ApiError(503, "the server is at capacity; retry later", None, "server_error")
            self._queue.append(Pending(rows, future))
            self._queued_rows += len(rows)
            self.metrics.queued.set(self._queued_rows)
            self._cond.notify()
        return future

    def _take(self) -> list[tuple[Pending, int]]:
        """(request, row index) of the next forward: rows in arrival order while rows x longest fits."""
        taken: list[tuple[Pending, int]] = []
        longest = 0
        for p in self._queue:  # no row is in flight meanwhile: each request goes on from its first row not done
            for i in range(p.done, len(p.rows)):
                n = max(longest, len(p.rows[i]))
                if taken and n * (len(taken) + 1) > self.cfg.max_batch_tokens:
                    return taken
                taken.append((p, i))
                longest = n
        return taken

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self.last_tick = time.monotonic()
                    self._cond.wait(1.0)
                if self._stopped:
                    for p in self._queue:
                        p.future.set_exception(ApiError(503, "the server is stopping", None, "server_error"))
                    return
                taken = self._take()
                self.busy_since = time.monotonic()
            try:
                vectors = self.embedder.embed_tokens([p.rows[i] for p, i in taken])
                error = None
            except Exception as e:  # noqa: BLE001 - the requests in this forward fail; the thread goes on
                vectors, error = None, e
            now = time.monotonic()
            self.metrics.forward_seconds.observe(now - self.busy_since)
            self.metrics.batch_rows.observe(len(taken))
            with self._cond:
                self.batches += 1
                for k, (p, i) in enumerate(taken):
                    if p.future.done():
                        continue
                    if error is not None:
                        p.future.set_exception(error)
                        continue
                    if p.vectors is None:
                        p.vectors = np.empty((len(p.rows), vectors.shape[1]), dtype=np.float32)
                    p.vectors[i] = vectors[k]
                    p.done = i + 1
                    if p.done == len(p.rows):
                        p.future.set_result(p.vectors)
                        self.metrics.latency.observe(now - p.arrived)
                self._queue = deque(p for p in self._queue if not p.future.done())
                self._queued_rows = sum(len(p.rows) - p.done for p in self._queue)
                self.metrics.queued.set(self._queued_rows)
                self.busy_since = None
                self.last_tick = now


def encode_input(req: EmbeddingsRequest, embedder, max_inputs: int) -> list[list[int]]:
    """The request's inputs as embedder rows (checked: one ApiError naming ``input`` for a bad one)."""
    x = req.input
    if isinstance(x, str):
        items: list = [x]
    elif x and all(isinstance(t, int) for t in x):
        items = [list(x)]
    else:
        items = list(x)
    if not items:
        raise ApiError(400, "input must not be empty: give a string or a list of strings", "input")
    if len(items) > max_inputs:
        raise ApiError(400, f"input has {len(items)} items; this server takes at most {max_inputs} per request "
                            "(embeddings.max_inputs)", "input")
    vocab, half, end = embedder.args.vocab_size, embedder.max_tokens, embedder.end
    rows = []
    for k, item in enumerate(items):
        where = "input" if isinstance(x, str) or len(items) == 1 else f"input[{k}]"
        if isinstance(item, str):
            if not item:
                raise ApiError(400, f"{where} is an empty string", "input")
            rows.append(embedder.encode([item])[0])
        else:
            if not item:
                raise ApiError(400, f"{where} is an empty list of token ids", "input")
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"{where}: token id {bad} is outside this model's vocabulary [0, {vocab})",
                               "input")
            rows.append(list(item[:half - 1]) + [end])
    return rows


def embeddings_response(vectors: np.ndarray, encoding: str, model: str, tokens: int) -> dict:
    def one(v: np.ndarray):
        if encoding == "base64":  # little-endian float32, as OpenAI's client decodes it
            return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        return v.tolist()

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": one(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def create_embeddings_app(embedder, batcher: Batcher, model_name: str, metrics: EmbeddingsMetrics,
                          max_inputs: int) -> FastAPI:
    app = FastAPI(title="Stalwart embeddings", docs_url=None, redoc_url=None)
    install_error_handlers(app, lambda: metrics.outcome("rejected"))

    @app.get("/health")
    async def health():
        body = {"status": "ok", "model": model_name, "dim": embedder.dim, "batches": batcher.batches}
        problem = batcher.problem()
        if problem is not None:
            return JSONResponse({**body, "status": "error", "error": problem}, 503)
        return body

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "stalwart",
                                           "max_model_len": embedder.max_tokens, "embedding_dim": embedder.dim}]}

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingsRequest):
        if req.model and req.model != model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}", "model",
                           "not_found_error")
        if req.encoding_format not in ("float", "base64"):
            raise ApiError(400, f"encoding_format must be 'float' or 'base64' (got {req.encoding_format!r})",
                           "encoding_format")
        if req.dimensions is not None and req.dimensions != embedder.dim:
            raise ApiError(400, f"dimensions: this model's embeddings have {embedder.dim} dimensions and are not "
                                f"shortened; leave dimensions out or give {embedder.dim}", "dimensions")
        rows = encode_input(req, embedder, max_inputs)
        try:
            vectors = await asyncio.wrap_future(batcher.submit(rows))
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - the forward failed; the server goes on
            raise ApiError(500, f"embedding failed ({type(e).__name__}: {e})", None, "server_error") from None
        tokens = sum(len(r) for r in rows)
        metrics.inputs.inc(len(rows))
        metrics.tokens.inc(tokens)
        metrics.outcome("ok")
        return embeddings_response(vectors, req.encoding_format, model_name, tokens)

    def not_here(request: Request):
        raise ApiError(400, f"{model_name} is an embeddings model: it answers POST /v1/embeddings; serve a language "
                            f"model (stalwart serve --run LM_RUN) for {request.url.path}", None)

    app.post("/v1/completions")(not_here)
    app.post("/v1/chat/completions")(not_here)
    return app


def embedder_path(source) -> Path:
    """The one path ``Embedder`` loads from: a checkpoint, a run directory or a Hugging Face directory."""
    if source.hf is not None:
        return source.hf
    return Path(source.checkpoint) if source.checkpoint else source.run


def check_embeddings_layout(cfg: ServeConfig) -> None:
    """An embeddings model is served by one process on the host: refuse what asks otherwise (one line)."""
    layout, engine = cfg.layout, cfg.engine
    if layout.tp * layout.pp > 1 or layout.replicas > 1 or layout.router or layout.prefill_replicas:
        raise UserError("an embeddings model is served by one process: leave layout.tp, layout.pp, "
                        "layout.replicas and the router at their defaults")
    if engine.device not in ("auto", HOST.type) or engine.quantize != "none" or engine.dtype != "float32":
        raise UserError("an embeddings model runs in float32 on the host CPU: leave engine.device (auto or cpu), "
                        "engine.dtype and engine.quantize at their defaults")
    if cfg.retrieval.index:
        raise UserError("retrieval.* serves retrieval-augmented completions of a language model; an embeddings "
                        "model serves /v1/embeddings alone")


def run_embeddings(cfg: ServeConfig, source, port_file: Path | None = None) -> int:
    """Serve the embeddings model ``source`` until SIGINT/SIGTERM."""
    from stalwart.retrieval.embed import Embedder
    from stalwart.serve.http import serve

    check_embeddings_layout(cfg)
    embedder = Embedder(embedder_path(source))
    embedder.batch_size = 1 << 30  # the batcher sizes each forward; embed_tokens runs it as one
    name = cfg.server.model_name or source.name
    metrics = EmbeddingsMetrics(name)
    batcher = Batcher(embedder, cfg.embeddings, metrics).start()
    try:
        app = create_embeddings_app(embedder, batcher, name, metrics, cfg.embeddings.max_inputs)
        what = (f"{name} (embeddings, {embedder.dim} dimensions, at most {embedder.max_tokens} tokens a text; "
                f"cpu, {cfg.embeddings.max_batch_tokens} tokens a forward)")
        serve(app, cfg.server.host, cfg.server.port, what, port_file)
    finally:
        batcher.stop()
    return 0
