"""The router in front of several replicas (each a full `stalwart serve` on a loopback port).

Each request goes, among the replicas known to be up, where the routing policy says (serve/prefix.py:
the replica holding the longest cached prefix of its prompt unless that unbalances the load, else the
one with the fewest requests in flight; or least-load; or round-robin). With prefill and decode
replicas (serve/disagg.py) a stream's prompt goes to a prefill replica, which hands it off to a decode
replica after the first token. A replica is down from the moment a connection to
it fails or its ``/health`` is not ok (probed every second), and up again once its ``/health`` is.

No request is lost with a replica. One that gets no answer (the replica died, its engine failed, or it
is full) is sent to the next replica. A stream that breaks off, or ends early because its replica
stopped, is resumed on another replica from where it stood (serve/resume.py): the client's stream goes
on under the same id with the tokens an undisturbed one would have had; if no replica can take it,
the stream ends with an error event, never silently. A replica process that exits is started again,
and one whose ``/health`` stays failed (its engine dead or stuck) for a while is killed and started
again; it rejoins once healthy (serve/fleet.py: the replicas' processes and their supervision). A weight
update goes to every replica (a 502 names any it could not reach).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from stalwart.config.serve import ServeConfig
from stalwart.serve.applied import AppliedWeights
from stalwart.serve.disagg import PREFILL_FIELD, Roles, discard
from stalwart.serve.errors import error_body, install_error_handlers
from stalwart.serve.fleet import Fleet, Replicas, supervision, wait_for_ports
from stalwart.serve.http import ClientGone, unless_client_leaves
from stalwart.serve.prefix import Policy, Prompts, pick, prompt_digests
from stalwart.serve.resume import HEADER, RESUME_FIELD, StreamRecord

DRAIN_TIMEOUT_S = 300.0  # the longest a weight update waits for a replica's requests to finish
RESUME_WAIT_S = 180.0  # a router over one replica waits this long for it to be back to resume a stream


def create_router(backends: list[str], fleet: Fleet | None = None, secret: str | None = None,
                  policy: Policy | None = None, prompts: Prompts | None = None, roles: Roles | None = None) -> FastAPI:
    """The router over replicas at ``backends`` (updated in place when one restarts on a new port);
    ``fleet``: their processes, restarted here; ``secret``: the one they were given (serve/resume.py);
    ``policy``: where to send each request (default least-load); ``prompts``: reads a body's prompt
    tokens (for cache-aware routing); ``roles``: which replicas prefill and which decode."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
    n = len(backends)
    policy = policy or Policy("least-load", n, 0, 1.0)
    roles = roles or Roles(n)
    cache_aware = policy.name == "cache-aware" and prompts is not None
    replicas = Replicas(n)  # what the router knows of each replica (serve/fleet.py)
    in_flight, served, restarts, up = replicas.in_flight, replicas.served, replicas.restarts, replicas.up
    starting, draining, last_update, weights_seen = (replicas.starting, replicas.draining, replicas.last_update,
                                                     replicas.weights_seen)
    routed = {"content-type": "application/json", **({HEADER: secret} if secret else {})}

    check, probe = supervision(replicas, backends, fleet, client, policy, routed, cache_aware)

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

    async def send(path: str, body: bytes, headers: dict, skip: set[int], among: tuple[list[int], list[int]],
                   digests: list[bytes] | None = None) -> tuple[httpx.Response | None, int, str]:
        """The first replica's answer (headers read) that is not a failure of the replica itself: (the
        response, the replica, why the others failed). None when no replica answered so. ``among``: the
        replicas to try first and those to fall back on; in each, the policy's order for ``digests``."""
        failures, last, last_i = [], None, -1
        usable = [u and not d for u, d in zip(up, draining)]
        for i in [i for group in among for i in policy.order(in_flight, usable, digests, group)]:
            if i in skip or starting[i]:
                continue
            in_flight[i] += 1
            try:
                upstream = await client.send(client.build_request("POST", backends[i] + path, content=body,
                                                                  headers=headers), stream=True)
            except httpx.HTTPError as e:  # nothing reached the client yet: mark it down, try the next
                in_flight[i] -= 1
                up[i] = False
                failures.append(f"replica {i}: {str(e) or type(e).__name__}")
                continue
            if upstream.status_code in (500, 503):  # its engine failed, or it is full: the next may serve
                await upstream.aread()
                await upstream.aclose()
                in_flight[i] -= 1
                up[i] = up[i] and upstream.status_code == 503
                failures.append(f"replica {i}: {upstream.status_code}")
                last, last_i = upstream, i
                continue
            served[i] += 1
            policy.chose(i, digests)
            return upstream, i, "; ".join(failures)
        if last is not None:  # every replica refused: the last refusal, as it was
            return last, last_i, "; ".join(failures)
        return None, -1, "; ".join(failures) or "no replica is up"

    async def forward(request: Request, path: str):
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # a replica answers what is wrong with it
        for internal in (RESUME_FIELD, PREFILL_FIELD):
            if isinstance(parsed, dict) and internal in parsed:
                return error_body(400, f"{internal} is internal to stalwart's router and is not accepted from "
                                       "clients", internal)
        headers = {**routed, "content-type": request.headers.get("content-type", "application/json")}
        streams = isinstance(parsed, dict) and parsed.get("stream") is True
        digests = digests_of(path, parsed)
        if roles.disaggregated and streams:  # the prompt on a prefill replica, which hands it off
            body = json.dumps({**parsed, PREFILL_FIELD: True}).encode()
        try:
            upstream, i, why = await unless_client_leaves(request, send(path, body, headers, set(),
                                                                        roles.first(streams), digests))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the replica saw the connection close
        if upstream is None:
            return error_body(502, f"no replica could take the request ({why})", None, "server_error")
        keep = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "cache-control")}
        if upstream.is_closed:  # a refusal read in full by send()
            return Response(upstream.content, upstream.status_code, headers=keep)
        if upstream.status_code == 200 and streams:
            return StreamingResponse(resumable(upstream, i, path, parsed, headers, digests), headers=keep)
        return StreamingResponse(_relay(upstream, in_flight, i), status_code=upstream.status_code, headers=keep)

    def digests_of(path: str, parsed: object) -> list[bytes] | None:
        """The block digests of a request's (first) prompt, for cache-aware routing; None if not known."""
        bs = policy.view.block_size
        if not cache_aware or bs is None or not isinstance(parsed, dict):
            return None
        tokens = prompts.tokens(path, parsed)
        return prompt_digests(tokens[0], bs) if tokens else None

    async def resumable(upstream: httpx.Response, i: int, path: str, body: dict, headers: dict,
                        digests: list[bytes] | None):
        """Relay a stream; when its replica is lost, resume it on another (serve/resume.py); when a
        prefill replica hands it off, go on from its first token on a decode replica (serve/disagg.py)."""
        record, tried = StreamRecord(), set()
        while True:
            handed = False
            try:
                async for data in _events(upstream):
                    if data == "[DONE]":
                        if record.kv:  # handed off: on to a decode replica
                            handed = True
                            break
                        yield b"data: [DONE]\n\n"
                        return
                    event = json.loads(data)
                    if record.kv and not event.get("choices") and "usage" in event:
                        continue  # the decode replica sends the usage of the whole stream
                    error = event.get("error")
                    if isinstance(error, dict) and error.get("type") == "server_error":
                        break  # the replica's engine failed
                    if any(c.get("finish_reason") == "abort" for c in event.get("choices") or []):
                        break  # the replica is stopping (only it ends a stream with "abort")
                    yield f"data: {json.dumps(record.take(event))}\n\n".encode()
            except httpx.HTTPError:
                pass  # the replica is gone
            finally:
                await upstream.aclose()
                in_flight[i] -= 1
            if not handed:
                up[i] = False
                tried.add(i)
            # Nothing relayed yet: the request as it came; else from where the stream stood.
            if record.id is None:
                again, among = body, roles.first(True)
                if roles.disaggregated:
                    again = {**body, PREFILL_FIELD: True}
            else:
                again, among = {**body, RESUME_FIELD: record.resume().to_json()}, (roles.decode, roles.prefill)
            names = record.handed_off()
            resume = json.dumps(again)
            upstream, i, why = await send(path, resume.encode(), headers, tried, among, digests)
            discard(fleet.kv_dir if fleet else None, names)  # read by the decode replica, or by nobody
            if upstream is None and n == 1 and fleet is not None:  # the one replica: resume once it is back
                upstream, i, why = await send_when_back(path, resume.encode(), headers)
            if upstream is None or upstream.status_code != 200:
                if upstream is not None:
                    why = f"replica {i}: {upstream.status_code} {upstream.text[:200]}"
                message = (f"the replica serving this stream was lost after {sum(map(len, record.tokens.values()))} "
                           f"tokens and no replica could resume it ({why})")
                error = {"message": message, "type": "server_error", "param": None, "code": None}
                yield f"data: {json.dumps({'error': error})}\n\n".encode()
                yield b"data: [DONE]\n\n"
                return

    async def send_when_back(path: str, body: bytes, headers: dict) -> tuple[httpx.Response | None, int, str]:
        """``send`` once a replica is up again (started again by ``supervise``), within ``RESUME_WAIT_S``."""
        deadline = time.monotonic() + RESUME_WAIT_S
        while time.monotonic() < deadline:
            if any(u and not s for u, s in zip(up, starting)):
                return await send(path, body, headers, set(), (roles.decode, roles.prefill))
            await asyncio.sleep(0.2)
        return None, -1, f"no replica was back within {RESUME_WAIT_S:.0f} s"

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
        ok = await asyncio.gather(*(check(i) for i in range(n)))
        return JSONResponse({"status": "ok" if all(ok) else "degraded", "replicas": [
            {"url": b, "ok": k, "in_flight": f, "served": s, "restarts": r, "weight_version": v, "role": roles.name(i)}
            for i, (b, k, f, s, r, v) in enumerate(zip(backends, ok, in_flight, served, restarts, weights_seen))],
            "routing": policy.stats()}, 200 if any(ok) else 503)

    @app.post("/v1/weights")
    async def weights(request: Request):
        """Every replica takes the update. By default one at a time, each once its requests are done
        (it takes no new ones meanwhile; the others serve), so no response mixes two versions;
        ``"drain": false`` updates all at once, requests in flight going on under the new weights."""
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or parsed.get("drain", True) is not False or parsed.get("live"):
            replies = []
            for i in range(n):
                replies.append(await drained(i, lambda: client.post(backends[i] + "/v1/weights", content=body,
                                                                    headers=routed)))
                if not isinstance(replies[-1], Exception) and replies[-1].status_code != 200:
                    break  # refused: refused by every replica alike, and none has changed
        else:
            replies = await asyncio.gather(*(client.post(b + "/v1/weights", content=body, headers=routed)
                                             for b in backends), return_exceptions=True)
        lost = [i for i, r in enumerate(replies) if isinstance(r, Exception)]
        if lost:
            for i in lost:
                up[i] = False
            codes = ", ".join(f"replica {i}: {r.status_code}" for i, r in enumerate(replies) if i not in lost)
            return error_body(502, f"replica {', '.join(map(str, lost))} unreachable, not updated; the others "
                                   f"answered ({codes or 'none'})", None, "server_error")
        bad = [r for r in replies if r.status_code != 200]
        r = bad[0] if bad else replies[0]
        if not bad and isinstance(parsed, dict):
            # What a replica that missed it is given: the weights as the replicas recorded them (a run
            # pinned to the checkpoint read, a live update's snapshot), else the body's source.
            recorded = AppliedWeights(fleet.weights[0]).source() if fleet is not None and fleet.weights else None
            version = r.json()["weight_version"]
            if recorded is not None and recorded["version"] == version:
                last_update.clear()
                last_update.update(recorded)
            elif not parsed.get("live"):
                last_update.clear()
                last_update.update(source=parsed["source"], version=version)
        return Response(r.content, r.status_code, media_type="application/json")

    async def drained(i: int, update):
        """``update()`` once replica ``i`` has no request in flight (or ``DRAIN_TIMEOUT_S`` passed); it takes
        no new requests meanwhile. The reply, or the exception that stood for one."""
        draining[i] = True
        try:
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while in_flight[i] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return await update()
        except httpx.HTTPError as e:
            return e
        finally:
            draining[i] = False

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
        lines += ["# HELP stalwart_router_replica_restarts_total Times the replica was started again.",
                  "# TYPE stalwart_router_replica_restarts_total counter"]
        lines += [f'stalwart_router_replica_restarts_total{{replica="{i}"}} {r}' for i, r in enumerate(restarts)]
        lines += ["# HELP stalwart_router_prefix_blocks_total Prompt blocks routed, and of them held by the replica "
                  "chosen (cache-aware routing's hit rate).", "# TYPE stalwart_router_prefix_blocks_total counter"]
        stats = policy.stats()
        lines += [f'stalwart_router_prefix_blocks_total{{kind="{k}"}} {stats[k + "_blocks"]}' for k in ("prompt", "matched")]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


async def _events(upstream: httpx.Response):
    """The data of each server-sent event of ``upstream``."""
    data: list[str] = []
    async for line in upstream.aiter_lines():
        if line.startswith("data: "):
            data.append(line[6:])
        elif not line and data:
            yield "\n".join(data)
            data = []


async def _relay(upstream: httpx.Response, in_flight: list[int], i: int):
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()
        in_flight[i] -= 1


def run_router(cfg: ServeConfig, name: str, fleet: Fleet, port_file: Path | None, secret: str | None,
               prompts: Prompts | None = None) -> int:
    from stalwart.serve.http import serve

    ports = wait_for_ports(fleet.procs, fleet.files)
    backends = [f"http://127.0.0.1:{p}" for p in ports]
    layout = cfg.layout
    policy = Policy(layout.routing, len(backends), layout.balance_abs, layout.balance_rel)
    roles = Roles(len(backends), layout.prefill_replicas)
    split = f"{layout.prefill_replicas} prefill + {layout.decode_replicas} decode" if roles.disaggregated else \
        f"{len(backends)}"
    serve(create_router(backends, fleet, secret, policy, prompts, roles), cfg.server.host, cfg.server.port,
          f"{name} router ({layout.routing}) over {split} replicas (tp={layout.tp} pp={layout.pp} each)", port_file)
    return 0
