"""A least-loaded router in front of several replicas (each a full `stalwart serve` on a loopback port).

Each request goes to the replica with the fewest requests in flight through this router (ties go to
the lowest index), and streams pass through as they arrive. A weight update goes to every replica.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from stalwart.config.serve import ServeConfig
from stalwart.errors import UserError


def pick(in_flight: list[int]) -> int:
    """The least-loaded replica (lowest index on ties)."""
    return min(range(len(in_flight)), key=lambda i: (in_flight[i], i))


def create_router(backends: list[str]) -> FastAPI:
    app = FastAPI(title="Stalwart router", docs_url=None, redoc_url=None)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
    in_flight = [0] * len(backends)
    served = [0] * len(backends)

    async def forward(request: Request, path: str):
        i = pick(in_flight)
        in_flight[i] += 1
        served[i] += 1
        body = await request.body()
        try:
            upstream = await client.send(client.build_request(
                request.method, backends[i] + path, content=body,
                headers={"content-type": request.headers.get("content-type", "application/json")}), stream=True)
        except httpx.HTTPError as e:
            in_flight[i] -= 1
            return JSONResponse({"error": {"message": f"replica {i} unreachable: {e}", "type": "server_error",
                                           "param": None, "code": None}}, 502)

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                in_flight[i] -= 1

        headers = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "cache-control")}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        r = await client.get(backends[0] + "/v1/models")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        replies = await asyncio.gather(*(client.get(b + "/health") for b in backends), return_exceptions=True)
        ok = [not isinstance(r, Exception) and r.status_code == 200 for r in replies]
        return JSONResponse({"status": "ok" if all(ok) else "degraded", "replicas": [
            {"url": b, "ok": k, "in_flight": n, "served": s} for b, k, n, s in zip(backends, ok, in_flight, served)]},
            200 if any(ok) else 503)

    @app.post("/v1/weights")
    async def weights(request: Request):
        body = await request.body()
        replies = await asyncio.gather(*(client.post(b + "/v1/weights", content=body,
                                                     headers={"content-type": "application/json"}) for b in backends))
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
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


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
