"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, health, metrics, weights.

Every request is checked before it is queued (a bad one gets a 4xx with OpenAI's error body and never
reaches the engine); a streaming client that disconnects has its request aborted, freeing its cache.
Every response carries the weight version that produced it (``system_fingerprint`` and
``weight_versions``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stalwart.infer.engine import Output, RequestError
from stalwart.infer.sampling import SamplingError
from stalwart.serve.loop import EngineLoop, Timing
from stalwart.serve.metrics import ServeMetrics
from stalwart.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    WeightsRequest,
    chat_chunk,
    chat_prompt,
    chat_response,
    completion_chunk,
    completion_response,
)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


class Job:
    """One engine request seen from the event loop: its outputs arrive on an asyncio queue."""

    def __init__(self, app_loop: asyncio.AbstractEventLoop, metrics: ServeMetrics) -> None:
        self.rid = uuid.uuid4().hex
        self.queue: asyncio.Queue[Output] = asyncio.Queue()
        self.timing = Timing(time.monotonic())
        self.metrics = metrics
        self.versions: list[int] = []
        self._loop = app_loop

    def sink(self, out: Output) -> None:  # engine thread
        now = time.monotonic()
        if out.choices:
            t = self.timing
            if t.first_token is None:
                t.first_token = now
                self.metrics.ttft.observe(now - t.arrived)
            else:
                self.metrics.tpot.observe(now - t.last_token)
            t.last_token = now
            if not self.versions or self.versions[-1] != out.weight_version:
                self.versions.append(out.weight_version)
        self._loop.call_soon_threadsafe(self.queue.put_nowait, out)


def create_app(loop: EngineLoop, model_name: str, metrics: ServeMetrics | None = None) -> FastAPI:
    engine = loop.engine
    tokenizer = engine.tokenizer
    metrics = metrics or ServeMetrics(model_name)
    loop.on_step = lambda outs, s: metrics.step(sum(len(o.choices) for o in outs), s, engine.stats())
    app = FastAPI(title="Stalwart", docs_url=None, redoc_url=None)
    state: dict[str, Any] = {"version": engine.weight_version}

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        metrics.outcome("rejected")
        return error_body(e.status, e.message, e.param, e.kind)

    @app.exception_handler(SamplingError)
    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, e: ValueError):
        metrics.outcome("rejected")
        return error_body(400, str(e))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        metrics.outcome("rejected")
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return error_body(400, "the request body is not valid JSON")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        where = loc[0] if loc else "request"
        return error_body(400, f"{where}: {first.get('msg', 'malformed request')}", where)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "weight_version": engine.weight_version}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                           "owned_by": "stalwart", "max_model_len": engine.args.max_seq_len}]}

    def check_model(name: str | None) -> None:
        if name and name != model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {model_name!r}", "model",
                           "not_found_error")

    def start(prompt: list[int], params) -> Job:
        if loop.queued() >= engine.cfg.max_queue:
            raise ApiError(503, "the server is at capacity; retry later", None, "server_error")
        engine.check(prompt, params)  # a RequestError or SamplingError becomes a 400
        job = Job(asyncio.get_running_loop(), metrics)
        metrics.prompt_tokens.inc(len(prompt))
        loop.submit(job.rid, prompt, params, job.sink)
        return job

    async def collect(job: Job) -> tuple[list[Output], Output]:
        outs = []
        while True:
            out = await job.queue.get()
            if out.finish_reason == "error":
                raise ApiError(400, out.text)
            outs.append(out)
            if out.finished:
                return outs, out

    def stream(jobs: list[Job], chunk) -> StreamingResponse:
        async def events():
            pending = {j.rid for j in jobs}
            try:
                waiters = {asyncio.ensure_future(j.queue.get()): (i, j) for i, j in enumerate(jobs)}
                while waiters:
                    done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                    for fut in done:
                        i, job = waiters.pop(fut)
                        out = fut.result()
                        if out.finish_reason == "error":
                            yield f"data: {json.dumps({'error': {'message': out.text}})}\n\n"
                            pending.discard(job.rid)
                            continue
                        yield f"data: {json.dumps(chunk(i, out, job))}\n\n"
                        if out.finished:
                            pending.discard(job.rid)
                        else:
                            waiters[asyncio.ensure_future(job.queue.get())] = (i, job)
                metrics.outcome("ok")
                yield "data: [DONE]\n\n"
            finally:
                for rid in pending:  # the client went away: free the engine's work
                    loop.abort(rid)
                    metrics.outcome("cancelled")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        prompts = req.token_prompts(tokenizer)
        jobs = [start(p, req.sampling()) for p in prompts]
        created = int(time.time())
        if req.stream:
            return stream(jobs, lambda i, out, job: completion_chunk(job.rid, created, model_name, i, out, tokenizer))
        results = [await collect(j) for j in jobs]
        metrics.outcome("ok")
        return completion_response(jobs, results, prompts, created, model_name, tokenizer, req.logprobs)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        check_model(req.model)
        prompt = tokenizer.encode(chat_prompt(req.messages), add_special_tokens=False).ids
        job = start(prompt, req.sampling())
        created = int(time.time())
        if req.stream:
            return stream([job], lambda i, out, j: chat_chunk(j.rid, created, model_name, out, tokenizer,
                                                                req.logprobs))
        outs, last = await collect(job)
        metrics.outcome("ok")
        return chat_response(job, outs, last, len(prompt), created, model_name, tokenizer, req.logprobs)

    @app.post("/v1/weights")
    async def update_weights(req: WeightsRequest):
        """Pause, load new weights, resume: the requests in flight go on under the new version."""
        version = req.version if req.version is not None else state["version"] + 1
        try:
            await asyncio.wrap_future(loop.update_weights(req.source, version))
        except Exception as e:  # the reader's error names what is wrong; the old weights stay
            raise ApiError(400, f"source: {e}", "source") from None
        state["version"] = version
        return {"weight_version": version, "source": req.source}

    return app
