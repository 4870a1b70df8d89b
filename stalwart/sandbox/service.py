"""The sandbox as an HTTP service: `stalwart sandbox serve` (alias `stalwart rl sandbox --serve`).

Reward workers on many hosts send programs to a few sandbox hosts (``workers.sandbox_urls``, through
``client.SandboxClient``) instead of each running bubblewrap itself. The service runs every
program exactly as ``Sandbox.score`` does locally, under its own ``[sandbox]`` limits, so a program
gets the same verdict either way.

    POST /v1/score   {"program": str, "cases": [{"input": str, "output": str}, ...]}
                     -> 200 {"reward": float, "passed": int, "total": int, "reason": str}
                     or a batch, run one after another in one sandbox (``Sandbox.score_many``):
                     {"programs": [{"program": ..., "cases": ...}, ...]} -> 200 {"verdicts": [...]}
    GET  /health     -> {"status": "ok", "running": n, "waiting": n, "concurrency": n, "queue": n}
    GET  /metrics    -> Prometheus text

JSON only: a body is parsed by ``json.loads`` and checked field by field, never unpickled. Per request:
at most ``service.max_request_mb`` of body (a larger one is refused before it is read, 413),
``service.max_programs`` programs and ``service.max_cases`` cases per program (413); malformed JSON or
fields are a 400 naming what is wrong. A batch takes one sandbox.

Bounded concurrency with back-pressure: ``service.concurrency`` sandboxes run at once and at most
``service.queue`` more requests wait; a request beyond them is answered at once with 429 and
``Retry-After: service.retry_after_s``, so a client tries another service or waits instead of piling
work onto this one. The service listens on loopback unless ``service.host`` says otherwise: whoever
reaches it can run programs in its sandboxes.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from stalwart.asgi import bind, run
from stalwart.config.sandbox import SandboxServiceConfig
from stalwart.sandbox.local import Sandbox, SandboxError, SandboxFull, cases_from
from stalwart.sandbox.warm import mem_available_mb

SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Admission:
    """Bounded concurrency and a bounded queue, as counts: ``enter`` admits a request while fewer than
    ``concurrency + queue`` are in the service; ``start`` / ``leave`` track the running ones."""

    def __init__(self, concurrency: int, queue: int) -> None:
        self.concurrency, self.queue = concurrency, queue
        self.admitted = 0
        self.running = 0
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return self.admitted - self.running

    def enter(self) -> bool:
        with self._lock:
            if self.admitted >= self.concurrency + self.queue:
                return False
            self.admitted += 1
            return True

    def start(self) -> None:
        with self._lock:
            self.running += 1

    def leave(self, started: bool) -> None:
        with self._lock:
            self.admitted -= 1
            self.running -= started


class ServiceMetrics:
    """The service's Prometheus metrics (one registry per app)."""

    def __init__(self, admission: Admission, sandbox: Sandbox | None = None) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open descriptors: its own load
        self.requests = Counter("stalwart_sandbox_requests", "Requests answered, by outcome (ok, busy, "
                                "bad_request, too_large, error).", ["outcome"], registry=r)
        self.programs = Counter("stalwart_sandbox_programs", "Programs scored, by whether every case passed.",
                                ["passed"], registry=r)
        self.cases = Counter("stalwart_sandbox_cases", "Test cases of the programs scored.", registry=r)
        self.seconds = Histogram("stalwart_sandbox_program_seconds", "Scoring one program, its sandbox start "
                                 "included (a batch's share of it; the wait in the queue not).",
                                 buckets=SECONDS_BUCKETS, registry=r)
        self.wait = Histogram("stalwart_sandbox_queue_seconds", "A request's wait for a free sandbox.",
                              buckets=SECONDS_BUCKETS, registry=r)
        Gauge("stalwart_sandbox_running", "Programs running now.", registry=r).set_function(
            lambda: admission.running)
        Gauge("stalwart_sandbox_waiting", "Requests waiting for a sandbox.", registry=r).set_function(
            lambda: admission.waiting)
        Gauge("stalwart_sandbox_concurrency", "Sandboxes run at once at most.", registry=r).set(admission.concurrency)
        Gauge("stalwart_sandbox_queue_limit", "Requests held waiting at most.", registry=r).set(admission.queue)
        if sandbox is not None:
            Gauge("stalwart_sandbox_sandboxes", "Sandboxes alive on this host (idle warm ones, busy and starting).",
                  registry=r).set_function(lambda: sandbox.pool.live)
            Gauge("stalwart_sandbox_warm_idle", "Warm sandboxes waiting for a request.",
                  registry=r).set_function(lambda: len(sandbox.pool._idle))
            Gauge("stalwart_sandbox_memory_available_bytes", "The host's MemAvailable (sandbox.memory_reserve_mb "
                  "refuses new sandboxes below it).", registry=r).set_function(lambda: mem_available_mb() * (1 << 20))


def sandboxes_at_once(cfg: SandboxServiceConfig) -> int:
    """``service.concurrency``, or two per CPU core: a sandbox spends part of its time starting processes
    (bubblewrap, the interpreter), so two per core score more programs per second than one."""
    return cfg.concurrency or 2 * (os.cpu_count() or 1)


class Refusal(Exception):
    """A request the service will not run: its HTTP status, outcome label and one-line reason."""

    def __init__(self, status: int, outcome: str, message: str) -> None:
        super().__init__(message)
        self.status, self.outcome = status, outcome


def parse_jobs(data: object, cfg: SandboxServiceConfig) -> tuple[list[tuple[str, list]], bool, list]:
    """The (program, cases) jobs of a request body, whether it was a batch, and each program's id (None
    where it carries none; its verdict repeats it); a Refusal names what is wrong."""
    batch = isinstance(data, dict) and set(data) == {"programs"}
    if batch:
        items = data["programs"]
        if not isinstance(items, list) or not items:
            raise Refusal(400, "bad_request", '"programs" must be a non-empty list of {"program", "cases"} objects')
        if len(items) > cfg.max_programs:
            raise Refusal(413, "too_large", f"{len(items)} programs; this service takes at most {cfg.max_programs} "
                                            "per request (service.max_programs)")
    else:
        items = [data]
    jobs, ids = [], []
    for i, item in enumerate(items):
        at = f"programs[{i}]: " if batch else ""
        if not (isinstance(item, dict) and set(item) - {"id"} == {"program", "cases"} and isinstance(item["program"], str)):
            raise Refusal(400, "bad_request", at + 'the body must be an object with exactly "program" (a string) '
                                                  'and "cases" (and, in a batch, an optional "id")')
        if "id" in item and not (batch and isinstance(item["id"], str) and 0 < len(item["id"]) <= 64):
            raise Refusal(400, "bad_request", at + '"id" must be a string of 1-64 characters, in a batch')
        ids.append(item.get("id"))
        try:
            cases = cases_from(item["cases"], "cases")
        except SandboxError as e:
            raise Refusal(400, "bad_request", at + str(e)) from None
        try:  # what the sandbox writes as files and pipes: lone surrogates are valid JSON but not UTF-8
            for text in (item["program"], *(t for c in cases for t in (c.input, c.output))):
                text.encode()
        except UnicodeEncodeError:
            raise Refusal(400, "bad_request", at + "the program and cases must be UTF-8 text (no lone "
                                                   "surrogates)") from None
        if len(cases) > cfg.max_cases:
            raise Refusal(413, "too_large", f"{at}{len(cases)} cases; this service takes at most {cfg.max_cases} "
                                            "per program (service.max_cases)")
        jobs.append((item["program"], cases))
    return jobs, batch, ids


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status, headers=headers)


def create_app(sandbox: Sandbox, cfg: SandboxServiceConfig) -> FastAPI:
    """The service's app over one ``Sandbox`` (shared by ``concurrency`` threads)."""
    concurrency = sandboxes_at_once(cfg)
    admission = Admission(concurrency, cfg.queue)
    metrics = ServiceMetrics(admission, sandbox)
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="sandbox")
    max_bytes = int(cfg.max_request_mb * (1 << 20))
    app = FastAPI(title="Stalwart sandbox", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.on_shutdown.append(lambda: pool.shutdown(wait=False, cancel_futures=True))

    def refuse(status: int, outcome: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.requests.labels(outcome=outcome).inc()
        return _error(status, message, headers)

    def run(jobs: list, queued_at: float) -> tuple[list, float]:
        admission.start()
        metrics.wait.observe(time.monotonic() - queued_at)
        t0 = time.monotonic()
        try:
            return sandbox.score_many(jobs), time.monotonic() - t0
        finally:
            admission.leave(started=True)

    @app.post("/v1/score")
    async def score(request: Request):
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            return refuse(413, "too_large", f"the request body ({declared} bytes) is larger than "
                                            f"service.max_request_mb ({cfg.max_request_mb} MiB)")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                return refuse(413, "too_large", f"the request body is larger than service.max_request_mb "
                                                f"({cfg.max_request_mb} MiB)")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return refuse(400, "bad_request", 'the body must be JSON: {"program": str, "cases": [{"input": str, '
                                              '"output": str}, ...]}')
        try:
            jobs, batch, ids = parse_jobs(data, cfg)
        except Refusal as r:
            return refuse(r.status, r.outcome, str(r))
        if not admission.enter():
            retry = max(1, math.ceil(cfg.retry_after_s))
            return refuse(429, "busy", f"all {concurrency} sandboxes are busy and {cfg.queue} requests wait; "
                                       "retry later or elsewhere", {"Retry-After": str(retry)})
        future = None
        try:
            future = pool.submit(run, jobs, time.monotonic())
            verdicts, seconds = await asyncio.wrap_future(future)
        except SandboxFull as e:  # no sandbox may start on this host now: another host, or later
            return refuse(429, "busy", str(e), {"Retry-After": str(max(1, math.ceil(cfg.retry_after_s)))})
        except Exception as e:  # noqa: BLE001 - the sandbox could not run (not the program: that is a verdict)
            return refuse(500, "error", f"the sandbox failed: {type(e).__name__}: {e}")
        finally:
            if future is None:
                admission.leave(started=False)
        metrics.requests.labels(outcome="ok").inc()
        for verdict in verdicts:
            metrics.programs.labels(passed=str(verdict.passed == verdict.total).lower()).inc()
            metrics.cases.inc(verdict.total)
            metrics.seconds.observe(seconds / len(verdicts))
        if not batch:
            return verdicts[0].as_dict()
        return {"verdicts": [v.as_dict() if i is None else {"id": i, **v.as_dict()} for i, v in zip(ids, verdicts)]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": admission.running, "waiting": admission.waiting,
                "concurrency": concurrency, "queue": cfg.queue}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(sandbox: Sandbox, cfg: SandboxServiceConfig, name: str = "stalwart sandbox") -> None:
    """Serve until SIGINT or SIGTERM (a graceful stop: requests running finish, exit status 0); ``name``
    (the command that was typed) starts the lines it prints."""
    shown = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    concurrency = sandboxes_at_once(cfg)

    def listening(port: int) -> None:
        print(f"{name}: serving on http://{shown}:{port} ({concurrency} sandboxes at once, "
              f"{cfg.queue} waiting at most)", flush=True)

    sock = bind(cfg.host, cfg.port, ("service.host", "--service.host"), ("service.port", "--service.port"))
    run(create_app(sandbox, cfg), sock, 10, listening)
    print(f"{name}: stopped", flush=True)
