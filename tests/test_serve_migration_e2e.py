"""Requests that survive a replica, through the real CLI: `stalwart serve --replicas 2` speculating with a
draft model, one server for every case. kill -9 of a replica mid-stream: every stream (greedy, seeded, a
structured output, chat) goes on on the other replica and ends with exactly the text, id and usage of an
undisturbed one; the dead replica is started again and rejoins. With no replica left to resume on, a stream ends with an
explicit error event, never silently. The resume field is the router's alone."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from test_serve_e2e import Server, process_tree, train

PROMPTS = ["def ", "import json\n", "class Foo(object):\n", "    return", "x = [1, 2]\nfor", "\"\"\"",
           "if __name__", "try:\n"]


def request(i: int) -> tuple[str, dict]:
    """Stream ``i`` of a mix: greedy and seeded completions, a structured output, a seeded chat."""
    if i == 6:  # a structured output, seeded: the grammar's state is rebuilt from the tokens sent
        return "/v1/completions", {"prompt": PROMPTS[i], "max_tokens": 100, "temperature": 1.0, "seed": 6,
                                   "structured_outputs": {"regex": "[a-z]{30}( [a-z0-9]{6}){8}"}}
    if i == 7:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": 100,
                                        "temperature": 0.8, "seed": 7}
    body = {"prompt": PROMPTS[i], "max_tokens": 100, "ignore_eos": True}
    return "/v1/completions", {**body, **({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": i})}


class Stream:
    def __init__(self, url: str, i: int) -> None:
        self.path, self.body = request(i)
        self.body.update(stream=True, stream_options={"include_usage": True})
        self.url, self.events, self.text = url, [], ""
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        with httpx.stream("POST", self.url + self.path, json=self.body, timeout=180) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    self.events.append(event)
                    for c in event.get("choices") or []:
                        self.text += c.get("text") or (c.get("delta") or {}).get("content") or ""

    def result(self) -> tuple[str, dict | None, set[str]]:
        self.thread.join(180)
        assert not self.thread.is_alive()
        return self.text, self.events[-1].get("usage"), {e.get("id") for e in self.events}


def streams(url: str) -> list[Stream]:
    return [Stream(url, i) for i in range(len(PROMPTS))]


def replicas(server: Server) -> list[int]:
    """The replica processes the command started (its children)."""
    return [p for p in process_tree(server.proc.pid)[1:] if _parent(p) == server.proc.pid]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def wait_healthy(server: Server, restarts: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(server.url + "/health", timeout=30).json()
        if health["status"] == "ok" and sum(r["restarts"] for r in health["replicas"]) == restarts:
            return health
        assert time.monotonic() < deadline, health
        time.sleep(0.5)


def kill_when_streaming(server: Server, running: list[Stream], victims: list[int]) -> None:
    """kill -9 ``victims`` once every stream has had a few chunks (so each is mid-stream)."""
    deadline = time.monotonic() + 60
    while any(len(s.events) < 4 for s in running):
        assert time.monotonic() < deadline, [len(s.events) for s in running]
        time.sleep(0.005)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    root = tmp_path_factory.mktemp("migration")
    train(root / "a", 0)
    # Speculating with a draft model (the run itself, reading a short window: its guesses are often
    # rejected): a resumed seeded stream is token-identical only if its draws follow its tokens, not its steps.
    server = Server(root, "--run", str(root / "a"), "--replicas", "2", "--engine.speculative", "draft",
                    "--engine.draft_model", str(root / "a"), "--engine.draft_window", "8")
    server.run = root / "a"
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.output()


def versions(server: Server) -> list[int]:
    """The weight version each replica serves."""
    return [httpx.get(r["url"] + "/health", timeout=30).json()["weight_version"]
            for r in httpx.get(server.url + "/health", timeout=30).json()["replicas"]]


@pytest.mark.e2e
def test_a_weight_update_drops_no_request_and_mixes_no_versions(routed):
    running = streams(routed.url)
    deadline = time.monotonic() + 60
    while any(len(s.events) < 2 for s in running):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    r = httpx.post(routed.url + "/v1/weights", json={"source": str(routed.run)}, timeout=300)
    assert r.status_code == 200 and r.json()["weight_version"] == 1, r.text
    for s in running:  # every stream finished, on the weights it began with
        text, usage, _ = s.result()
        assert usage["completion_tokens"] > 0 and {v for e in s.events for v in e["weight_versions"]} == {0}
    assert versions(routed) == [1, 1]
    refused = httpx.post(routed.url + "/v1/weights", json={"source": str(routed.run), "version": 1}, timeout=300)
    assert refused.status_code == 409 and versions(routed) == [1, 1]


@pytest.mark.e2e
def test_streams_survive_a_killed_replica_token_for_token(routed):
    expected = [s.result() for s in streams(routed.url)]
    assert len({text for text, _, _ in expected}) == len(PROMPTS)
    assert re.fullmatch("[a-z]{30}( [a-z0-9]{6}){8}", expected[6][0])
    running = streams(routed.url)
    kill_when_streaming(routed, running, replicas(routed)[:1])
    got = [s.result() for s in running]
    for (text, usage, ids), (want, want_usage, _) in zip(got, expected):
        assert (text, usage) == (want, want_usage) and len(ids) == 1
    health = wait_healthy(routed, restarts=1)  # the dead replica is back, with the weights the other serves
    assert all(r["ok"] for r in health["replicas"]) and versions(routed) == [1, 1], health
    assert [r["weight_version"] for r in health["replicas"]] == [1, 1], health  # the router's /health names them
    assert "replica" in routed.output() and "starting it again" in routed.output()
    assert [s.result()[0] for s in streams(routed.url)] == [text for text, _, _ in expected]
    drafts = [0.0, 0.0]  # proposed, kept: the replicas did speculate, with drafts kept and rejected
    for r in health["replicas"]:
        for i, kind in enumerate(("proposed", "kept")):
            found = re.search(rf'^stalwart_serve_speculative_drafts{{kind="{kind}",[^}}]*}} (\S+)$',
                              httpx.get(r["url"] + "/metrics", timeout=30).text, re.M)
            drafts[i] += float(found.group(1))
    assert drafts[0] > drafts[1] > 0, drafts


@pytest.mark.e2e
def test_a_stream_that_cannot_be_resumed_ends_with_an_error_event(routed):
    before = sum(r["restarts"] for r in httpx.get(routed.url + "/health").json()["replicas"])
    running = streams(routed.url)[:4]
    kill_when_streaming(routed, running, replicas(routed))  # every replica at once
    for s in running:
        s.result()
        last = s.events[-1]
        assert "error" in last and last["error"]["type"] == "server_error", last
        assert "no replica could resume it" in last["error"]["message"]
    assert before == 1  # (both come back as the first did; the fixture's stop stops them either way)


@pytest.mark.e2e
def test_the_resume_field_is_refused_from_clients(routed):
    r = httpx.post(routed.url + "/v1/completions", timeout=30, json={
        "prompt": "def ", "stream": True, "x_stalwart_resume": {"id": "x", "created": 0, "tokens": [[1]],
                                                                "finished": [False]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x_stalwart_resume", r.text
