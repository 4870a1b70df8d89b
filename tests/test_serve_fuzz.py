"""Random request bodies against the real app and engine (in process, over HTTP): every answer is a 200
or a 4xx/503 in OpenAI's error shape (never a 500, never a hang), every stream ends with [DONE], and
the server stays healthy and answers as before. Bounded: 300 bodies or 25 seconds, whichever is first,
from a fixed seed (a failure names the body to replay)."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from stalwart.config.serve import EngineConfig
from test_serve_app import InProcessServer, tokenizer  # noqa: F401 - the module's tokenizer fixture

pytestmark = pytest.mark.unit
BODIES, SECONDS = 300, 25.0

FIELDS = ["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "stop", "seed", "stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs", "echo",
          "ignore_eos", "logit_bias", "presence_penalty", "frequency_penalty", "min_tokens", "stop_token_ids",
          "response_format", "structured_outputs", "x_stalwart_resume", "user", "suffix"]


def value(rng: random.Random, depth: int = 0):
    """A JSON value of any type, biased to the edges: boundaries, huge and negative numbers, odd text."""
    kind = rng.randrange(12 if depth < 2 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 16, 29, 31, 32, 383, 384, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30])
    if kind == 3:
        return rng.randint(-50, 50)
    if kind == 4:
        return rng.choice([0.0, 0.5, 1.0, 2.0, 2.0001, -0.1, 1e308, -1e-308, 1e-9])
    if kind == 5:
        return rng.choice(["", "def ", "x" * 200, "\u0000", "\ud7ff\ue000", "🙂" * 5, "assistant:", "\n\n"])
    if kind == 6:
        return rng.choice(["text", "json_object", "json_schema", "user", "system", "robot", "a.b", "[a-z]+"])
    if kind == 7:
        return "".join(rng.choice("ab {}[]\"\\:,") for _ in range(rng.randrange(8)))
    if kind in (8, 9):
        return [value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 10:
        return [rng.randrange(-2, 400) for _ in range(rng.randrange(6))]
    return {rng.choice(FIELDS + ["role", "content", "type", "json", "regex", "choice", "schema", "include_usage"]):
            value(rng, depth + 1) for _ in range(rng.randrange(4))}


def body(rng: random.Random) -> tuple[str, bytes, dict]:
    """(path, raw body, headers): mostly JSON objects near a valid request, some not JSON at all."""
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/completions", "/v1/chat/completions",
                       "/v1/weights"])
    headers = {"content-type": "application/json"}
    roll = rng.random()
    if roll < 0.05:
        return path, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))), headers  # not UTF-8 at all
    if roll < 0.10:
        return path, json.dumps(value(rng)).encode(), headers  # any JSON value
    base = {"prompt": "def ", "max_tokens": 4} if "chat" not in path else {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    fields = {rng.choice(FIELDS): value(rng) for _ in range(rng.randrange(1, 5))}
    raw = json.dumps({**base, **fields}).encode()
    if rng.random() < 0.05:
        raw = raw[:rng.randrange(len(raw))]  # cut off
    if rng.random() < 0.05:
        headers = {"content-type": rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])}
    return path, raw, headers


@pytest.fixture(scope="module")
def server(tokenizer):  # noqa: F811
    s = InProcessServer(tokenizer, EngineConfig(max_seqs=4, max_batch_tokens=64, max_queue=16, kv_cache_mb=4))
    yield s
    s.close()


def test_random_bodies_never_wedge_the_server(server):
    reference = server.post("/v1/completions", {"prompt": "def ", "max_tokens": 6, "temperature": 0}).json()
    rng = random.Random(0)
    start, seen = time.monotonic(), {}
    with httpx.Client(timeout=30) as client:
        for i in range(BODIES):
            if time.monotonic() - start > SECONDS:
                break
            path, raw, headers = body(rng)
            replay = f"body {i}: POST {path} {raw[:300]!r}"
            with client.stream("POST", server.url + path, content=raw, headers=headers) as r:
                data = r.read()
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400, 404, 409, 503), (r.status_code, data[:300], replay)
            if r.status_code != 200:
                error = json.loads(data)["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], (data, replay)
            elif r.headers["content-type"].startswith("text/event-stream"):
                events = [x[6:] for x in data.decode().split("\n\n") if x.startswith("data: ")]
                assert events[-1] == "[DONE]", (data[-300:], replay)
                assert all(json.loads(e) for e in events[:-1])
            else:
                assert json.loads(data), replay
            if i % 25 == 0:
                assert client.get(server.url + "/health").status_code == 200, replay
    assert sum(seen.values()) >= 100 and seen.get(200) and seen.get(400), seen
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    again = server.post("/v1/completions", {"prompt": "def ", "max_tokens": 6, "temperature": 0}).json()
    assert again["choices"] == reference["choices"]
    assert not server.engine.requests and not server.engine.scheduler.waiting  # nothing left behind
