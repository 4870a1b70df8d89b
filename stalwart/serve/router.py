"""A least-loaded router in front of several replicas (each a full `stalwart serve` on a loopback port).

Each request goes to the replica with the fewest requests in flight through this router (ties go to
the lowest index), among the replicas known to be up, and streams pass through as they arrive. A
replica is down from the moment a connection to it fails or its ``/health`` is not ok (probed every
second), and up again once its ``/health`` is. A request whose replica fails before answering anything
is tried on the next one, so a replica that dies costs no request that it had not begun to answer.
A weight update goes to every replica (a 502 names any it could not reach).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from stalwart.config.serve import ServeConfig
from stalwart.errors import UserError
from stalwart.serve.errors import error_body, install_error_handlers

PROBE_INTERVAL_S = 1.0


def pick(in_flight: list[int], up: list[bool] | None = None) -> list[int]:
    """Replicas in the order to try them: up before down, then least loaded, then lowest index."""
    up = up if up is not None else [True] * len(in_flight)
    return sorted(range(len(in_flight)), key=lambda i: (not up[i], in_flight[i], i))


def create_router(backends: list[str]) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
    in_flight = [0] * len(backends)
    served = [0] * len(backends)
    up = [True] * len(backends)

    async def check(i: int) -> bool:
        try:
            r = await client.get(backends[i] + "/health", timeout=10.0)
            up[i] = r.status_code == 200
        except httpx.HTTPError:
            up[i] = False
        return up[i]

    async def probe() -> None:
        while True:
            await asyncio.gather(*(check(i) for i in range(len(backends))))
            await asyncio.sleep(PROBE_INTERVAL_S)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(probe())
        try:
            yield
        finally:
            task.cancel()
            await client.aclose()

    app = FastAPI(title="Stalwart router", docs_url=None, redoc_url=None, lifespan=lifespan)
    install_error_handlers(app)

    async def forward(request: Request, path: str):
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        failures = []
        for i in pick(in_flight, up):
            in_flight[i] += 1
            try:
                upstream = await client.send(client.build_request(request.method, backends[i] + path, content=body,
                                                                  headers=headers), stream=True)
            except httpx.HTTPError as e:  # nothing reached the client yet: mark it down, try the next
                in_flight[i] -= 1
                up[i] = False
                failures.append(f"replica {i}: {str(e) or type(e).__name__}")
                continue
            served[i] += 1
            return StreamingResponse(_relay(upstream, in_flight, i), status_code=upstream.status_code,
                                     headers={k: v for k, v in upstream.headers.items()
                                              if k.lower() in ("content-type", "cache-control")})
        return error_body(502, f"no replica could take the request ({'; '.join(failures)})", None, "server_error")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        return await forward_get("/v1/models")

    async def forward_get(path: str):
        for i in pick(in_flight, up):
            try:
                r = await client.get(backends[i] + path)
            except httpx.HTTPError:
                up[i] = False
                continue
            return Response(r.content, r.status_code, media_type="application/json")
        return error_body(502, "no replica is reachable", None, "server_error")

    @app.get("/health")
    async def health():
        ok = await asyncio.gather(*(check(i) for i in range(len(backends))))
        return JSONResponse({"status": "ok" if all(ok) else "degraded", "replicas": [
            {"url": b, "ok": k, "in_flight": n, "served": s} for b, k, n, s in zip(backends, ok, in_flight, served)]},
            200 if any(ok) else 503)

    @app.post("/v1/weights")
    async def weights(request: Request):
        body = await request.body()
        replies = await asyncio.gather(*(client.post(b + "/v1/weights", content=body,
                                                     headers={"content-type": "application/json"}) for b in backends),
                                       return_exceptions=True)
        lost = [i for i, r in enumerate(replies) if isinstance(r, Exception)]
        if lost:
            for i in lost:
                up[i] = False
            codes = ", ".join(f"replica {i}: {r.status_code}" for i, r in enumerate(replies) if i not in lost)
            return error_body(502, f"replica {', '.join(map(str, lost))} unreachable, not updated; the others "
                                   f"answered ({codes or 'none'})", None, "server_error")
        bad = [r for r in replies if r.status_code != 200]
        r = bad[0] if bad else replies[0]
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/metrics")
    async def metrics():
        lines = ["# HELP stalwart_router_in_flight Requests in flight per replica.",
                 "# TYPE stalwart_router_in_flight gauge"]
        lines += [f'stalwart_router_in_flight{{replica="{i}"}} {n}' for i, n in enumerate(in_flight)]
        lines += ["# HELP stalwart_router_requests_total Requests routed per replica.",
                  "# TYPE stalwart_router_requests_total counter"]
        lines += [f'stalwart_router_requests_total{{replica="{i}"}} {n}' for i, n in enumerate(served)]
        lines += ["# HELP stalwart_router_replica_up Whether the replica is taking requests.",
                  "# TYPE stalwart_router_replica_up gauge"]
        lines += [f'stalwart_router_replica_up{{replica="{i}"}} {int(u)}' for i, u in enumerate(up)]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


async def _relay(upstream: httpx.Response, in_flight: list[int], i: int):
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()
        in_flight[i] -= 1


def wait_for_ports(procs: list[subprocess.Popen], files: list[Path], timeout_s: float = 300.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if p.poll() is not None:
                raise UserError(f"replica {i} exited with code {p.returncode} before serving (see its message above)")
        if all(f.is_file() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.2)
    raise UserError(f"replicas did not start within {timeout_s:.0f} s")


def run_router(cfg: ServeConfig, name: str, procs: list[subprocess.Popen], files: list[Path],
               port_file: Path | None) -> int:
    from stalwart.serve.http import serve

    ports = wait_for_ports(procs, files)
    backends = [f"http://127.0.0.1:{p}" for p in ports]
    serve(create_router(backends), cfg.server.host, cfg.server.port,
          f"{name} router over {len(backends)} replicas (tp={cfg.layout.tp} pp={cfg.layout.pp} each)", port_file)
    return 0
