"""A replica that heals (serve/launcher.py, serve/heal.py, serve/standby.py), the parts that need no group
of processes: the crash-loop rule, the keeper's answer on a shared socket, the attempts a rank watches,
and an engine whose cache is lost mid-request recomputing it to the same tokens. The kills themselves run
through the CLI in tests/test_serve_e2e.py."""

from __future__ import annotations

import copy
import dataclasses
import signal
import socket
import threading

import httpx
import pytest

from stalwart.config.serve import EngineConfig
from stalwart.infer.engine import Engine
from stalwart.serve.launcher import CrashLoop, describe_exit
from stalwart.serve.standby import Standby

from test_infer_engine import GREEDY, ByteTokenizer, build, prompts

pytestmark = pytest.mark.unit


def test_a_crash_loop_is_failures_soon_after_a_start_in_a_row_per_process():
    loop = CrashLoop(limit=3, quick_s=60.0)
    assert not loop.failed(1, started=0.0, now=10.0)
    assert not loop.failed(1, started=10.0, now=20.0)
    assert not loop.failed(0, started=0.0, now=5.0)  # another process counts apart
    assert not loop.failed(1, started=20.0, now=200.0)  # a long run in between starts the count again
    assert not loop.failed(1, started=200.0, now=201.0)
    assert not loop.failed(1, started=201.0, now=202.0)
    assert loop.failed(1, started=202.0, now=203.0)


def test_exits_are_named_by_code_or_signal():
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(-200) == "was killed by signal 200"


def test_the_keeper_answers_503_with_retry_after_on_the_shared_socket_until_stopped():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    standby = Standby(sock, "m")
    try:
        standby.start("recovering", "rank 0 of this replica is being started again")
        r = httpx.get(url + "/health", timeout=10)
        assert (r.status_code, r.headers["retry-after"]) == (503, "1")
        assert r.json() == {"status": "recovering", "model": "m",
                            "error": "rank 0 of this replica is being started again"}
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_error" and "retry in 1 s" in r.json()["error"]["message"]
        # A client that sends nothing holds no one up: another is answered meanwhile.
        idle = socket.create_connection(sock.getsockname())
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        idle.close()
        standby.stop()
        # The socket stays open (rank 0 serves on it): a connection queues, unanswered, instead of failing.
        waiting = socket.create_connection(sock.getsockname(), timeout=5)
        waiting.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        waiting.settimeout(0.5)
        with pytest.raises(socket.timeout):
            waiting.recv(100)
        standby.start("starting", "the replica is starting")  # and it answers again once started again
        assert b" 503 " in waiting.recv(200).split(b"\r\n")[0] + b" "
        waiting.close()
    finally:
        standby.stop()
        sock.close()


def test_a_rank_sees_a_newer_attempt_from_its_watcher_or_the_store():
    from stalwart.runtime.group import controller_store
    from stalwart.serve.heal import ATTEMPT, GroupHealer, GroupPlace

    store = controller_store(2, 10.0)
    store.set(ATTEMPT, "0")
    healer = GroupHealer(GroupPlace(0, 2, store.port, None, 0), None, (1, 2))
    healer.attempt = 0
    wake, stopped = threading.Event(), threading.Event()
    healer.watch(wake, stopped.is_set)
    try:
        assert not healer.broken() and not healer.broken(0.2)
        store.set(ATTEMPT, "1")
        assert wake.wait(5) and healer.broken() and healer.broken(0.2)
        healer.attempt = 1  # joined it: a flag seen before does not count again
        assert not healer.broken() and not healer.broken(0.1)
    finally:
        stopped.set()


def test_an_engine_whose_cache_is_lost_mid_request_recomputes_the_same_tokens():
    """What rank 0 does when a rank is started again with an empty cache: every running sequence goes back
    to the queue in admission order and is recomputed, its cached prefixes forgotten; greedy tokens are
    those of an undisturbed run."""
    batch = prompts(4)
    params = dataclasses.replace(GREEDY, max_tokens=6)
    model = build()

    def run(lose_at: int | None) -> dict[str, list[int]]:
        engine = Engine(copy.deepcopy(model), ByteTokenizer(), None,
                        EngineConfig(block_size=4, max_batch_tokens=64, kv_cache_mb=1))
        for i, p in enumerate(batch):
            engine.add(str(i), p, dataclasses.replace(params))
        got: dict[str, list[int]] = {}
        steps = 0
        while engine.has_work():
            if steps == lose_at:
                running = [s.rid for s in engine.scheduler.running]
                assert len(running) > 1
                engine.recompute_all()
                assert engine.scheduler.running == [] and not engine.pool.by_digest
                assert [s.rid for s in engine.scheduler.waiting][:len(running)] == running
                assert engine.pool.used == engine.pool.reserved  # every block given back
            for o in engine.step():
                got.setdefault(o.rid, []).extend(c.token for c in o.choices)
            steps += 1
        return got

    assert run(lose_at=3) == run(lose_at=None)
