"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, health, metrics, weights.

Every request is checked before it is queued (a bad one gets a 4xx with OpenAI's error body and never
reaches the engine; the prompts of one request are all checked, then queued together); a streaming
client that disconnects has its request aborted, freeing its cache. Every response carries the weight
version that produced it (``system_fingerprint`` and ``weight_versions``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stalwart.comm.live import NotPublishing, NothingPublished
from stalwart.comm.weight_sync import WeightSyncError
from stalwart.errors import UserError
from stalwart.infer.outputs import Output, RequestError
from stalwart.infer.sampling import SamplingError, SamplingParams
from stalwart.serve.chat import ChatFormat
from stalwart.serve.disagg import PREFILL_FIELD, handoff_of, read_kv, write_kv
from stalwart.serve.errors import ApiError, error_body, install_error_handlers
from stalwart.serve.http import ClientGone, unless_client_leaves
from stalwart.serve.loop import EngineLoop, EngineUnavailable, Failure, Submission, Timing, WeightVersionError
from stalwart.serve.metrics import ServeMetrics
from stalwart.serve.rag import Retrieval, Retrieved, chat_query, chat_render, completion_render, with_sources
from stalwart.serve.resume import CHUNK_FIELD, RESUME_FIELD, Resume, from_router, resume_of
from stalwart.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    CompletionStream,
    SamplingRequest,
    WeightsRequest,
    chat_chunk,
    chat_response,
    completion_response,
    plan_draws,
    usage_chunk,
)


class Job:
    """One engine request seen from the event loop: its outputs arrive on an asyncio queue."""

    def __init__(self, app_loop: asyncio.AbstractEventLoop, metrics: ServeMetrics, emitted: list[int] = (),
                 done: bool = False, versions: list[int] = (), priority: int = 0) -> None:
        self.rid = uuid.uuid4().hex
        self.queue: asyncio.Queue[Output | Failure] = asyncio.Queue()
        self.timing = Timing(time.monotonic())
        self.priority = priority
        self.ttft, self.tpot = metrics.latency(priority)  # its class's histograms
        # A resumed request (serve/resume.py): the tokens sent before, whether it had finished, the versions.
        self.emitted = list(emitted)
        self.done = done
        self.timing.tokens = len(self.emitted)
        self.versions: list[int] = list(versions)
        self._loop = app_loop

    def sink(self, out: Output | Failure) -> None:  # engine thread
        now = time.monotonic()
        if isinstance(out, Output) and out.choices:
            t = self.timing
            if t.first_token is None:
                t.first_token = now
                self.ttft.observe(now - t.arrived)
            else:  # several tokens at once (speculative decoding's kept drafts): the interval shared out
                for _ in out.choices:
                    self.tpot.observe((now - t.last_token) / len(out.choices))
            t.last_token = now
            t.tokens += len(out.choices)
            if not self.versions or self.versions[-1] != out.weight_version:
                self.versions.append(out.weight_version)
        self._loop.call_soon_threadsafe(self.queue.put_nowait, out)


LIVE_TIMEOUT_S = 120.0  # a live update's default wait for the next publish (``timeout``)
RETRY_AFTER_S = 1  # what /health tells a client to wait while a process of the replica is started again


def _error_event(f: Failure) -> str:
    return f"data: {json.dumps({'error': {'message': f.message, 'type': f.kind, 'param': f.param, 'code': None}})}\n\n"


def create_app(loop: EngineLoop, model_name: str, metrics: ServeMetrics | None = None,
               router_secret: str | None = None, chat: ChatFormat | None = None, retrieval: Retrieval | None = None
               ) -> FastAPI:
    """The API over ``loop``; ``router_secret``: the secret of the router in front (serve/resume.py);
    ``chat`` renders conversations (the model's template; default: plain ``role: content`` lines);
    ``retrieval``: the indexes requests may retrieve from (serve/rag.py)."""
    engine = loop.engine
    chat_format = chat or ChatFormat()
    retrieval_reserve = retrieval.cfg.reserve_tokens if retrieval is not None else 0
    tokenizer = engine.tokenizer
    metrics = metrics or ServeMetrics(model_name)
    loop.on_step = lambda outs, s: metrics.step(sum(len(o.choices) for o in outs), s, engine.stats())
    app = FastAPI(title="Stalwart", docs_url=None, redoc_url=None)
    install_error_handlers(app, lambda: metrics.outcome("rejected"))
    if retrieval is not None:
        retrieval.bind_metrics(metrics.registry, model_name)

    @app.exception_handler(SamplingError)
    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, e: SamplingError | RequestError):
        metrics.outcome("rejected")
        return error_body(400, str(e), e.param)

    @app.get("/health")
    async def health():
        body = {"status": "ok", "model": model_name, "weight_version": engine.weight_version}
        problem = loop.problem()
        if problem is not None:  # the engine thread is gone or stuck: this server can answer nothing
            return JSONResponse({**body, "status": "error", "error": problem}, 503)
        recovering = loop.recovering()
        if recovering is not None:  # requests wait meanwhile and are served once it is whole again
            return JSONResponse({**body, "status": "recovering", "error": recovering}, 503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return body

    @app.get("/v1/cache")
    async def cache(request: Request):
        """The digests of the prompt blocks this replica's cache holds, for its router only (serve/prefix.py):
        which prompts others sent is nobody else's business."""
        if not from_router(request.headers, router_secret):
            raise ApiError(403, "the cache's contents are for stalwart's router only", None, "permission_error")
        for _ in range(3):  # the engine thread may change the dict while it is read: read it again
            try:
                held = list(engine.pool.by_digest)
                break
            except RuntimeError:
                held = []
        return {"block_size": engine.cfg.block_size, "digests": [d.hex() for d in held]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                           "owned_by": "stalwart", "max_model_len": engine.args.max_seq_len}]}

    @app.post("/v1/embeddings")
    async def embeddings():
        raise ApiError(400, f"{model_name} is a language model; /v1/embeddings is served by an embeddings model "
                            "(stalwart serve --run RUN of a run trained with --training.objective contrastive)", None)

    def check_model(name: str | None) -> None:
        if name and name != model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {model_name!r}", "model",
                           "not_found_error")

    async def retrieve(req: SamplingRequest, request: Request, query: str, render, reserve: int) -> Retrieved:
        """The prompt with its sources (serve/rag.py), leaving ``reserve`` tokens of the context for the answer."""
        if retrieval is None:
            raise ApiError(400, "this server has no retrieval indexes: start it with --retrieval.embedder, "
                                "--retrieval.index NAME=ADDRESS and --retrieval.keys", "retrieval")
        return await retrieval.augment(req.retrieval, request.headers.get("authorization"), query, render,
                                       engine.room(0) - reserve)

    def start(req: SamplingRequest, prompts: list[list[int]], params: list[SamplingParams],
              resume: Resume | None = None, leads: list[int | None] | None = None, handoff: bool = False
              ) -> list[Job]:
        """Check every prompt, then queue them together: a request runs whole or not at all. ``resume``:
        where the stream stood on a replica that was lost or handed it off (serve/resume.py, with the keys
        and values: serve/disagg.py). ``leads[k]``: the earlier submission whose prompt submission k shares
        (several choices of one prompt). ``handoff``: hand every output off after its first token."""
        limit = engine.cfg.max_queue
        if len(prompts) > limit:
            many = "sequences (prompts x n or best_of)" if req.draws > 1 else "prompts"
            raise ApiError(400, f"the request has {len(prompts)} {many}; this server queues at most {limit} "
                                f"requests (engine.max_queue)",
                           "prompt" if req.draws == 1 else "n" if req.draws == req.n else "best_of")
        try:
            for prompt, p in zip(prompts, params):
                engine.check(prompt, p)
        except (RequestError, SamplingError) as e:
            raise ApiError(400, str(e), req.param_name(e.param)) from None
        if loop.queued() + len(prompts) > limit:
            raise ApiError(503, "the server is at capacity; retry later", None, "server_error")
        here = asyncio.get_running_loop()
        jobs = [Job(here, metrics, resume.tokens[k], resume.finished[k], resume.versions, req.priority) if resume
                else Job(here, metrics, priority=req.priority) for k in range(len(prompts))]
        kvs = [read_kv(resume.kv[k]) if resume else None for k in range(len(jobs))]
        try:
            leads = leads or [None] * len(jobs)
            loop.submit([Submission(j.rid, prompt, p, j.sink, jobs[lead].rid if lead is not None else None,
                                    emitted=j.emitted, priority=j.priority, handoff=handoff, kv=kv)
                         for j, prompt, p, lead, kv in zip(jobs, prompts, params, leads, kvs) if not j.done])
        except EngineUnavailable as e:
            raise ApiError(e.status, str(e), None, "server_error") from None
        metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        return jobs

    async def collect(job: Job) -> tuple[list[Output], Output]:
        outs = []
        while True:
            out = await job.queue.get()
            if isinstance(out, Failure):
                raise ApiError(out.status, out.message, out.param, out.kind)
            outs.append(out)
            if out.finished:
                return outs, out

    def stream(jobs: list[Job], chunk: Callable[[int, Output], dict], usage: Callable[[], dict] | None,
               routed: bool = False):
        """Server-sent events: one chunk per output of any prompt, a usage chunk if asked, then [DONE].
        ``routed``: each chunk also says which output and tokens it carries, for the router."""

        async def events():
            pending = {j.rid for j in jobs if not j.done}
            try:
                waiters = {asyncio.ensure_future(j.queue.get()): (i, j) for i, j in enumerate(jobs) if not j.done}
                while waiters:
                    done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                    for fut in done:
                        i, job = waiters.pop(fut)
                        out = fut.result()
                        if isinstance(out, Failure):
                            yield _error_event(out)
                            pending.discard(job.rid)
                            continue
                        event = chunk(i, out)
                        if usage is not None:
                            event["usage"] = None
                        if routed:
                            event[CHUNK_FIELD] = {"job": i, "tokens": [c.token for c in out.choices],
                                                  "finished": out.finished}
                            if out.kv is not None:  # handed off: its keys and values for a decode replica
                                event[CHUNK_FIELD]["kv"] = write_kv(out.kv)
                        yield f"data: {json.dumps(event)}\n\n"
                        if out.finished:
                            pending.discard(job.rid)
                        else:
                            waiters[asyncio.ensure_future(job.queue.get())] = (i, job)
                if usage is not None:
                    yield f"data: {json.dumps(usage())}\n\n"
                metrics.outcome("ok")
                yield "data: [DONE]\n\n"
            finally:
                for rid in pending:  # the client went away: free the engine's work
                    loop.abort(rid)
                    metrics.outcome("cancelled")

        return StreamingResponse(events(), media_type="text/event-stream")

    def usage_of(rid: str, kind: str, created: int, jobs: list[Job], prompts: list[list[int]]):
        return lambda: usage_chunk(rid, kind, created, model_name, sorted({v for j in jobs for v in j.versions}),
                                   sum(len(p) for p in prompts), sum(j.timing.tokens for j in jobs))

    async def resumed(request: Request, outputs: int, streams: bool) -> tuple[bool, Resume | None, bool]:
        """(whether the router sent ``request``, the stream it resumes if any, whether a prefill replica
        hands it off after its first token: serve/disagg.py)."""
        routed = from_router(request.headers, router_secret)
        body = await request.body()
        internal = RESUME_FIELD.encode() in body or PREFILL_FIELD.encode() in body
        parsed = json.loads(body) if internal else None
        resume = resume_of(parsed, routed, outputs) if internal else None
        if resume is not None and not streams:
            raise ApiError(400, f"{RESUME_FIELD} resumes streams only", RESUME_FIELD)
        return routed, resume, handoff_of(parsed, routed, streams)

    async def collect_all(request: Request, jobs: list[Job]) -> list[tuple[list[Output], Output]]:
        """Every job's outputs; a client that leaves first has its jobs aborted (ClientGone)."""
        try:
            return await unless_client_leaves(request, asyncio.gather(*(collect(j) for j in jobs)))
        except ClientGone:
            for j in jobs:
                loop.abort(j.rid)
            metrics.outcome("cancelled")
            raise

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        found = None
        if req.retrieval is not None:
            if not isinstance(req.prompt, str) or req.echo:
                raise ApiError(400, "retrieval takes one prompt string, without echo", "prompt")
            found = await retrieve(req, request, req.prompt, completion_render(req.prompt, tokenizer),
                                   max(req.max_tokens or 16, 1))
        prompts = [found.tokens] if found else req.token_prompts(tokenizer)
        draws, params = plan_draws(req, len(prompts), req.sampling())
        routed, resume, handoff = await resumed(request, len(draws), req.stream)
        jobs = start(req, [prompts[d.prompt] for d in draws], params, resume, [d.lead for d in draws], handoff)
        rid, created = (resume.id, resume.created) if resume else (f"cmpl-{uuid.uuid4().hex}", int(time.time()))
        texts = req.prompt_texts(prompts, tokenizer) if req.echo else []
        if req.stream:
            usage = usage_of(rid, "text_completion", created, jobs, prompts) if req.include_usage else None
            chunks = CompletionStream(rid, created, model_name, tokenizer, req, draws, prompts, texts)
            if resume is not None:  # outputs that began on the lost replica: their prompt (echo) was sent
                chunks.started.update(k for k, j in enumerate(jobs) if j.emitted or j.done)
            return stream(jobs, with_sources(chunks.chunk, found) if found else chunks.chunk, usage, routed)
        results = await collect_all(request, jobs)
        metrics.outcome("ok")
        body = completion_response(rid, req, draws, jobs, results, prompts, texts, created, model_name, tokenizer)
        return {**body, **found.extension()} if found else body

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check_model(req.model)
        found = None
        if req.retrieval is not None:
            reserve = req.max_completion_tokens or req.max_tokens or retrieval_reserve
            found = await retrieve(req, request, chat_query(req), chat_render(req, chat_format, tokenizer),
                                   max(reserve, 1))
        prompt = found.tokens if found else req.token_prompt(tokenizer, chat_format)
        draws, params = plan_draws(req, 1, req.sampling(room=engine.room(len(prompt))))
        routed, resume, handoff = await resumed(request, len(draws), req.stream)
        jobs = start(req, [prompt] * len(draws), params, resume, [d.lead for d in draws], handoff)
        rid, created = (resume.id, resume.created) if resume else (f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
        if req.stream:
            usage = usage_of(rid, "chat.completion.chunk", created, jobs, [prompt]) if req.include_usage else None
            chunk = lambda k, out: chat_chunk(rid, created, model_name, draws[k].j, out, tokenizer,  # noqa: E731
                                              req.logprobs)
            return stream(jobs, with_sources(chunk, found) if found else chunk, usage, routed)
        results = await collect_all(request, jobs)
        metrics.outcome("ok")
        body = chat_response(rid, req, jobs, results, len(prompt), created, model_name, tokenizer)
        return {**body, **found.extension()} if found else body

    async def update_live(req: WeightsRequest):
        """The next weights the training run ``source`` publishes, waited for while the engine serves on."""
        if req.version is not None:
            raise ApiError(400, "version: a live update's version is the step the trainers send; leave it out",
                           "version")
        timeout = req.timeout or LIVE_TIMEOUT_S
        cancelled = threading.Event()
        t0 = time.monotonic()
        try:
            pending = loop.update_live(req.source, timeout, cancelled)
        except UserError as e:
            raise ApiError(400, str(e), "live") from None
        except EngineUnavailable as e:
            raise ApiError(e.status, str(e), None, "server_error") from None
        try:
            version = await asyncio.wrap_future(pending)
        except EngineUnavailable as e:
            raise ApiError(e.status, str(e), None, "server_error") from None
        except WeightVersionError as e:
            raise ApiError(409, str(e), "version", "conflict_error") from None
        except NothingPublished:
            raise ApiError(504, f"{req.source} published no weights within timeout = {timeout:g} s; the served "
                                f"weights (version {engine.weight_version}) stay", "timeout",
                           "timeout_error") from None
        except (NotPublishing, UserError) as e:
            raise ApiError(400, f"source: {e}", "source") from None
        except (WeightSyncError, RuntimeError, OSError) as e:  # the transfer failed: the old weights stay
            raise ApiError(502, f"receiving the weights of {req.source} failed ({type(e).__name__}: {e}); the "
                                f"served weights (version {engine.weight_version}) stay", None, "server_error") from None
        finally:
            cancelled.set()  # a client gone while waiting: the subscription is given up
        return {"weight_version": version, "source": req.source, "live": True,
                "seconds": round(time.monotonic() - t0, 3)}

    @app.post("/v1/weights")
    async def update_weights(req: WeightsRequest):
        """Pause, load new weights, resume: the requests in flight go on under the new version."""
        if req.live:
            return await update_live(req)
        if req.timeout is not None:
            raise ApiError(400, "timeout applies to live updates only (\"live\": true)", "timeout")
        try:
            version = await asyncio.wrap_future(loop.update_weights(req.source, req.version))
        except EngineUnavailable as e:
            raise ApiError(e.status, str(e), None, "server_error") from None
        except WeightVersionError as e:
            raise ApiError(409, str(e), "version", "conflict_error") from None
        except Exception as e:  # noqa: BLE001 - the reader's error names what is wrong; the old weights stay
            raise ApiError(400, f"source: {e}", "source") from None
        return {"weight_version": version, "source": req.source}

    return app
