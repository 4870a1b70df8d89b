"""Prefill and decode on separate replicas through the real CLI: `stalwart serve --prefill-replicas 1
--decode-replicas 2`, one server for every case. Every stream (greedy, seeded, a structured output, a
chat) is prefilled on the prefill replica, handed off with its keys and values and decoded on a decode
replica, and ends with exactly the text of the same request answered whole by one replica (colocated);
kill -9 of a decode replica mid-stream, or of the prefill replica holding streams not yet handed off,
loses none of them."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from test_serve_e2e import Server, train
from test_serve_migration_e2e import PROMPTS, Stream, kill_when_streaming, replicas, request, wait_healthy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("disagg")
    train(root / "a", 0)
    server = Server(root, "--run", str(root / "a"), "--prefill-replicas", "1", "--decode-replicas", "2")
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.output()


def whole(url: str, i: int) -> str:
    """Request ``i`` answered whole (no stream: one decode replica does both)."""
    path, body = request(i)
    r = httpx.post(url + path, json=body, timeout=180).json()
    c = r["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def imported(server: Server) -> float:
    health = httpx.get(server.url + "/health", timeout=30).json()
    total = 0.0
    for r in health["replicas"]:
        text = httpx.get(r["url"] + "/metrics", timeout=30).text
        total += sum(float(x) for x in re.findall(r'^stalwart_serve_kv_handoff_tokens{kind="imported"[^}]*} (\S+)$',
                                                  text, re.M))
    return total


def test_handed_off_streams_equal_one_replica_and_survive_killed_replicas(split):
    assert [r["role"] for r in httpx.get(split.url + "/health", timeout=30).json()["replicas"]] == \
        ["prefill", "decode", "decode"]
    colocated = [whole(split.url, i) for i in range(len(PROMPTS))]
    before = imported(split)
    running = [Stream(split.url, i) for i in range(len(PROMPTS))]
    for i, s in enumerate(running):
        text, usage, ids = s.result()
        assert text == colocated[i] and len(ids) == 1 and usage["completion_tokens"] > 0, i
        assert all(c.get("finish_reason") != "handoff" for e in s.events for c in e.get("choices") or [])
    assert imported(split) > before  # the decode replicas took the keys and values, not recomputed them

    prefill, *decode = sorted(replicas(split))
    running = [Stream(split.url, i) for i in range(len(PROMPTS))]
    kill_when_streaming(split, running, decode[:1])  # a decode replica, mid-stream
    for i, s in enumerate(running):
        assert s.result()[0] == colocated[i], i
    wait_healthy(split, restarts=1)

    os.kill(prefill, signal.SIGSTOP)  # streams wait on it, not handed off yet; then it dies
    running = [Stream(split.url, i) for i in range(4)]
    time.sleep(2.0)
    os.kill(prefill, signal.SIGKILL)
    for i, s in enumerate(running):
        assert s.result()[0] == colocated[i], i
    wait_healthy(split, restarts=2)
