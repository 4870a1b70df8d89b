"""A server that cannot be wedged and streams that survive their replica, in process (the real app and
engine on a tiny model over HTTP): a stream resumed from any point with the router's extension goes on
with exactly the tokens of an undisturbed one (greedy and seeded, one prompt or several); the extension
is refused without the router's secret; a client that leaves a request that is not streamed has it
aborted; a stuck engine turns /health to 503. The router and real replicas are in
test_serve_migration_e2e.py."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time

import httpx
import pytest

import test_serve_app
from stalwart.config.serve import EngineConfig
from stalwart.serve.app import create_app
from stalwart.serve.resume import CHUNK_FIELD, HEADER, RESUME_FIELD, StreamRecord
from test_serve_app import InProcessServer, tokenizer  # noqa: F401 - the module's tokenizer fixture

pytestmark = pytest.mark.unit
SECRET = "s3cret"
ROUTER = {HEADER: SECRET}


@pytest.fixture(scope="module")
def server(tokenizer, request):  # noqa: F811
    # The app as a router's replica: it knows the router's secret.
    patch = pytest.MonkeyPatch()
    patch.setattr(test_serve_app, "create_app", functools.partial(create_app, router_secret=SECRET))
    try:
        s = InProcessServer(tokenizer, EngineConfig(max_seqs=4, max_batch_tokens=64, kv_cache_mb=4))
    finally:
        patch.undo()
    yield s
    s.close()


def events(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def text_by_choice(chunks: list[dict]) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for ch in c.get("choices") or []:
            out[ch["index"]] = out.get(ch["index"], "") + ch["text"]
    return out


BODIES = [  # greedy, seeded, seeded with top-k and a stop string, two prompts at once
    {"prompt": "def ", "max_tokens": 20, "temperature": 0, "ignore_eos": True},
    {"prompt": "import json\n", "max_tokens": 20, "temperature": 1.0, "seed": 11, "ignore_eos": True},
    {"prompt": "class Foo", "max_tokens": 20, "temperature": 0.9, "top_k": 20, "seed": 2**64 - 1, "stop": ["zz"],
     "ignore_eos": True},
    {"prompt": ["def ", "x = ["], "max_tokens": 12, "temperature": 1.2, "seed": 5, "ignore_eos": True},
    {"prompt": "def ", "max_tokens": 12, "temperature": 0.9, "seed": 4, "n": 2, "echo": True, "ignore_eos": True},
]


@pytest.mark.parametrize("body", BODIES, ids=["greedy", "seeded", "top_k_stop", "two_prompts", "n_echo"])
def test_a_stream_resumed_anywhere_goes_on_exactly_as_undisturbed(server, body):
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    whole = events(server.url, body, ROUTER)
    assert all(CHUNK_FIELD in c for c in whole if c.get("choices"))
    record = StreamRecord()
    chunks = [record.take(dict(c)) for c in whole]
    expected, usage = text_by_choice(chunks), chunks[-1]["usage"]
    for cut in (1, 5, len(chunks) // 2, len(chunks) - 2):  # the replica lost after `cut` chunks
        record = StreamRecord()
        before = [record.take(dict(c)) for c in whole[:cut]]
        after = events(server.url, {**body, RESUME_FIELD: record.resume().to_json()}, ROUTER)
        rest = [StreamRecord().take(dict(c)) for c in after]
        assert text_by_choice(before + rest) == expected, cut
        assert {c["id"] for c in before + rest} == {whole[0]["id"]}
        assert rest[-1]["usage"] == usage  # the original prompt and every token, whichever replica made it


def test_the_resume_field_is_the_routers_alone(server):
    resume = {"id": "x", "created": 0, "tokens": [[1, 2, 3]], "finished": [False]}
    body = {"prompt": "def ", "max_tokens": 8, "stream": True, RESUME_FIELD: resume}
    for headers in (None, {HEADER: "wrong"}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == RESUME_FIELD, r.text
    plain = events(server.url, {"prompt": "def ", "max_tokens": 3, "stream": True})
    assert plain and not any(CHUNK_FIELD in c for c in plain)  # and a client never sees the chunk field
    bad = {**body, RESUME_FIELD: {**resume, "tokens": [[99999]]}}
    r = httpx.post(server.url + "/v1/completions", json=bad, headers=ROUTER, timeout=30)
    assert "resumed request" in r.text  # an error event naming it; the server goes on
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_a_client_that_leaves_an_answer_it_waits_for_has_it_aborted(server, monkeypatch):
    step = server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda: (time.sleep(0.1), step())[1])  # 3 s for 28 tokens
    generated = server.engine.tokens_generated
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as s:
        body = json.dumps({"prompt": "def ", "max_tokens": 28, "ignore_eos": True, "temperature": 0}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.5)
        assert len(server.engine.requests) == 1
    deadline = time.monotonic() + 10
    while server.engine.requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.engine.requests
    assert server.engine.tokens_generated - generated < 20  # aborted, not run to its end
    assert 'outcome="cancelled"' in httpx.get(server.url + "/metrics").text


def test_a_stuck_engine_turns_health_to_503_and_back(server, monkeypatch):
    step = server.engine.step

    def slow_step():
        time.sleep(1.5)
        return step()

    monkeypatch.setattr(server.loop, "step_limit_s", 0.5)
    monkeypatch.setattr(server.engine, "step", slow_step)
    answers: list[httpx.Response] = []
    pending = threading.Thread(target=lambda: answers.append(server.post("/v1/completions", {
        "prompt": "def ", "max_tokens": 2})))
    pending.start()
    deadline = time.monotonic() + 5
    health = httpx.get(server.url + "/health")
    while health.status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
        health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and "stuck: one step has run for" in health.json()["error"], health.text
    monkeypatch.setattr(server.engine, "step", step)  # it comes unstuck: healthy again, the request answered
    pending.join(30)
    assert answers[0].status_code == 200 and httpx.get(server.url + "/health").json()["status"] == "ok"
