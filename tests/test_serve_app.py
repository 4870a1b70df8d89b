"""The OpenAI-compatible server in process: the real app and engine on a tiny model, served by uvicorn on
a loopback port and spoken to over HTTP (OpenAI's own client where it fits). Bad fields are 400s that
name the field; a request is admitted whole or not at all; chat output may fill the context; streams
carry one id and, on request, their usage; a failed engine says so instead of leaving requests waiting.
The CLI, several processes and weight updates from real runs are in test_serve_e2e.py."""

from __future__ import annotations

import json
import re
import sysconfig
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from stalwart.config.serve import EngineConfig
from stalwart.data.tokenizer import eos_id, train_bpe
from stalwart.infer.engine import Engine
from stalwart.infer.scheduler import Sequence
from stalwart.models.flavors import TransformerArgs
from stalwart.models.llama import Transformer
from stalwart.serve.app import create_app
from stalwart.serve.http import bind
from stalwart.serve.loop import EngineLoop
from stalwart.train.init import materialize_and_init

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.unit

CONTEXT = 32
ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=384, ffn_hidden=128,
                       max_seq_len=CONTEXT, init_std=0.4)


@pytest.fixture(scope="module")
def tokenizer():
    texts = [p.read_text() for p in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))]
    return train_bpe(texts, ARGS.vocab_size)


class InProcessServer:
    def __init__(self, tokenizer, cfg: EngineConfig, chat=None, args: TransformerArgs = ARGS) -> None:
        with torch.device("meta"):
            model = Transformer(args)
        materialize_and_init(model, torch.device("cpu"), 0)
        self.engine = Engine(model.eval(), tokenizer, eos_id(tokenizer), cfg)
        self.loop = EngineLoop(self.engine).start()
        sock = bind("127.0.0.1", 0)
        sock.listen()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.loop, "tiny", chat=chat), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return float(re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.loop.stop()


@pytest.fixture(scope="module")
def server(tokenizer):
    # Two sequences at a time and four waiting at most: concurrent requests meet a full queue.
    s = InProcessServer(tokenizer, EngineConfig(max_seqs=2, max_batch_tokens=64, max_queue=4, kv_cache_mb=4))
    yield s
    s.close()


def error(r: httpx.Response) -> tuple[int, str | None, str]:
    e = r.json()["error"]
    return r.status_code, e["param"], e["message"]


BAD_FIELDS = [  # (path, body, the param the error names, part of its message)
    ("/v1/completions", {"prompt": "def ", "seed": 99999999999999999999999}, "seed", "seed must be an integer in"),
    ("/v1/completions", {"prompt": "def ", "seed": -9223372036854775809}, "seed", "seed must be an integer in"),
    ("/v1/completions", {"prompt": "def ", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    ("/v1/completions", {"prompt": "def ", "max_tokens": 40}, "max_tokens", "exceeds the model's context of 32"),
    ("/v1/completions", {"prompt": "def " * 40}, "prompt", "leaves no room for output"),
    ("/v1/completions", {"prompt": "def ", "temperature": 3}, "temperature", "temperature must be in [0, 2]"),
    ("/v1/completions", {"prompt": "def ", "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "def ", "top_k": -1}, "top_k", "top_k must be >= 0"),
    ("/v1/completions", {"prompt": "def ", "logprobs": 21}, "logprobs", "logprobs must be in [0, 20]"),
    ("/v1/completions", {"prompt": "def ", "stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
    ("/v1/completions", {"prompt": "def ", "stop": 5}, "stop", "stop must be a string or a list of strings"),
    ("/v1/completions", {"prompt": "def ", "n": 17}, "n", "n must be in [1, 16]"),
    ("/v1/completions", {"prompt": 5}, "prompt", "prompt must be a string, a list of strings"),
    ("/v1/completions", {"prompt": [400]}, "prompt", "token ids must be in [0, 384)"),
    # Strict types: nothing is coerced.
    ("/v1/completions", {"prompt": "def ", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": "def ", "max_tokens": True}, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": "def ", "stream": "yes"}, "stream", "valid boolean"),
    ("/v1/completions", {}, "prompt", "prompt: Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens",
     "max_tokens must be >= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens", "max_completion_tokens must be >= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 30},
     "max_completion_tokens", "exceeds the model's context"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 40}]}, "messages",
     "leaves no room for output"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 30}, "top_logprobs", "in [0, 20]"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages", "messages[0].role"),
    ("/v1/chat/completions", {"messages": []}, "messages", "must not be empty"),
]


@pytest.mark.parametrize("path,body,param,message", BAD_FIELDS, ids=[str(i) for i in range(len(BAD_FIELDS))])
def test_a_bad_field_is_a_400_naming_it_and_the_server_goes_on(server, path, body, param, message):
    status, got_param, got = error(server.post(path, body))
    assert (status, got_param) == (400, param) and message in got, got
    ok = server.post("/v1/completions", {"prompt": "def ", "max_tokens": 2, "seed": 7})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_malformed_bodies_and_unknown_routes_get_openai_errors(server):
    cases = [
        (httpx.post(server.url + "/v1/completions"), 400, "the request has no body"),
        (httpx.post(server.url + "/v1/completions", content="hi", headers={"content-type": "text/plain"}), 400,
         "must be a JSON object, sent with Content-Type: application/json"),
        (httpx.post(server.url + "/v1/completions", json=[1, 2]), 400, "must be a JSON object"),
        (httpx.get(server.url + "/v1/nothing"), 404, "there is no /v1/nothing here; this server answers /health"),
        (httpx.delete(server.url + "/v1/completions"), 405, "DELETE is not allowed on /v1/completions (use POST)"),
    ]
    for r, status, message in cases:
        assert r.status_code == status and message in r.json()["error"]["message"], r.text
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.completions.create(model="gpt-4", prompt="x")


def test_chat_output_fills_the_context_unless_max_tokens_says_otherwise(server):
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == CONTEXT
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_completion_tokens=3)
    assert r.usage.completion_tokens <= 3
    # A completion without max_tokens keeps OpenAI's default of 16.
    r = server.client.completions.create(model="tiny", prompt="def ", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_a_request_is_admitted_whole_or_not_at_all(server):
    time.sleep(0.3)  # the metrics of earlier requests' last steps are in
    before = server.metric("stalwart_serve_generation_tokens_total")
    # The second prompt is too long: nothing of the request runs.
    status, param, _ = error(server.post("/v1/completions", {"prompt": ["def", "x " * 40], "max_tokens": 20}))
    assert (status, param) == (400, "prompt")
    status, param, message = error(server.post("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"]}))
    assert (status, param) == (400, "prompt") and "queues at most 4" in message
    time.sleep(0.3)
    assert server.metric("stalwart_serve_generation_tokens_total") == before
    # Requests of four prompts each against a queue of four: some wait their turn, others get a 503, and
    # every token generated belongs to a request that was answered.
    replies: list[httpx.Response] = []
    body = {"prompt": ["def", "import", "class", "return"], "max_tokens": 16, "ignore_eos": True}
    threads = [threading.Thread(target=lambda: replies.append(server.post("/v1/completions", body)))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = sorted(r.status_code for r in replies)
    assert set(codes) == {200, 503}, codes
    answered = sum(r.json()["usage"]["completion_tokens"] for r in replies if r.status_code == 200)
    time.sleep(0.3)
    assert server.metric("stalwart_serve_generation_tokens_total") - before == answered == 64 * codes.count(200)


def test_a_stream_has_one_id_and_its_usage_on_request(server):
    chunks = list(server.client.completions.create(model="tiny", prompt=["def", "import"], max_tokens=3,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}))
    assert len({c.id for c in chunks}) == 1
    assert {c.choices[0].index for c in chunks[:-1]} == {0, 1}
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6 and last.usage.prompt_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    chat = list(server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=2, stream=True,
                                                      stream_options={"include_usage": True}))
    assert len({c.id for c in chat}) == 1 and chat[-1].usage.completion_tokens == 2
    # Without stream_options: no usage chunk.
    plain = list(server.client.completions.create(model="tiny", prompt="def", max_tokens=2, stream=True))
    assert all(c.choices and c.usage is None for c in plain)


def test_a_failed_engine_fails_every_request_and_health_says_so(tokenizer):
    s = InProcessServer(tokenizer, EngineConfig(kv_cache_mb=4))
    try:
        # The engine meets a sequence it has no request for (what a request that failed halfway into the
        # engine used to leave behind): its step raises.
        s.engine.scheduler.add(Sequence("orphan", [1, 2, 3], 3, 8))
        r = s.post("/v1/completions", {"prompt": "def ", "max_tokens": 4})
        assert r.status_code == 500 and "the engine stopped (KeyError" in r.json()["error"]["message"]
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        with pytest.raises(openai.InternalServerError, match="the server must be restarted"):
            s.client.completions.create(model="tiny", prompt="x", max_tokens=2)
        with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=30) as r:
            assert r.status_code == 500 and "the engine stopped" in json.loads(r.read())["error"]["message"]
    finally:
        s.close()


def test_listening_socket_is_tcp_so_answers_are_not_held_for_delayed_acks():
    """asyncio turns on TCP_NODELAY only for sockets created as IPPROTO_TCP; without it an answer on a
    kept-alive connection waited ~40 ms for the client's delayed ACK (measured 44.5 ms per request
    against 4.7 ms with it)."""
    import socket

    from stalwart.serve.http import bind

    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
