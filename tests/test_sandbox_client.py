"""The sandbox service's client and admission as pure logic (no sandbox, no sockets): the client
spreads programs over the services, skips busy and unreachable ones, honours Retry-After, never
retries a refusal that would repeat, and checks every verdict it is given; admission holds at most
concurrency + queue requests. The service itself, for real, is in test_sandbox_e2e.py."""

import json
import threading

import httpx
import pytest

from stalwart.sandbox import client as sandbox_client
from stalwart.sandbox.local import Case, SandboxError, Verdict
from stalwart.sandbox.client import SandboxClient
from stalwart.sandbox.service import Admission

pytestmark = pytest.mark.unit

PASSED = {"reward": 1.0, "passed": 1, "total": 1, "reason": "passed"}
CASES = [Case("1", "2")]


def _client(answers: dict[str, list], retry_s: float = 5.0) -> tuple[SandboxClient, list[str]]:
    """A client over services a..z whose answers come from ``answers[host]`` in turn (an exception is
    raised as the transport's); the hosts asked, in order."""
    asked: list[str] = []
    lock = threading.Lock()

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # a down service's health: back at once (health_s 0)
            return httpx.Response(200, json={"status": "ok"})
        with lock:
            asked.append(request.url.host)
            answer = answers[request.url.host].pop(0)
        if isinstance(answer, Exception):
            raise answer
        assert json.loads(request.content) == {"program": "print(2)", "cases": [{"input": "1", "output": "2"}]}
        status, body, headers = answer
        return httpx.Response(status, json=body, headers=headers)

    urls = [f"http://{h}:8077/" for h in answers]
    return SandboxClient(urls, retry_s, http=httpx.Client(transport=httpx.MockTransport(handle)), health_s=0.0), asked


def test_programs_go_to_the_services_in_turn(monkeypatch):
    client, asked = _client({"a": [(200, PASSED, {})] * 2, "b": [(200, PASSED, {})] * 2})
    assert [client.score("print(2)", CASES) for _ in range(4)] == [Verdict(1.0, 1, 1, "passed")] * 4
    assert asked == ["a", "b", "a", "b"]


def test_busy_and_unreachable_services_are_skipped_then_retried_after_the_wait_they_asked_for(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(sandbox_client.time, "sleep", slept.append)
    refused = httpx.ConnectError("connection refused")
    client, asked = _client({"a": [(429, {"error": "busy"}, {"Retry-After": "2"}), (200, PASSED, {})],
                             "b": [refused, refused]})
    assert client.score("print(2)", CASES) == Verdict(1.0, 1, 1, "passed")
    assert asked == ["a", "b", "b", "a"]  # b is down, back once its health answers (at once here, health_s 0)
    assert len(slept) == 1 and 2.0 <= slept[0] <= 3.0  # a's Retry-After, with jitter above it
    # nobody asked for a wait: the backoff doubles from 0.1 s (jitter below it)
    slept.clear()
    client, asked = _client({"c": [refused, (503, {"error": "stopping"}, {}), refused, (200, PASSED, {})]})
    assert client.score("print(2)", CASES) == Verdict(1.0, 1, 1, "passed")
    assert [round(x / b, 1) >= 0.5 and x <= b for x, b in zip(slept, (0.1, 0.2, 0.4))] == [True] * 3


def test_no_answer_within_the_budget_names_every_service(monkeypatch):
    clock = iter(range(1000))
    monkeypatch.setattr(sandbox_client.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(sandbox_client.time, "sleep", lambda s: None)
    refused = httpx.ConnectError("connection refused")
    client, _ = _client({"a": [refused] * 10, "b": [(429, {"error": "all 2 sandboxes are busy"}, {})] * 10},
                        retry_s=3)
    with pytest.raises(SandboxError, match=r"within workers.sandbox_retry_s \(3 s\) \(http://a:8077: ConnectError: "
                                           r"connection refused; http://b:8077: 429 all 2 sandboxes are busy\)"):
        client.score("print(2)", CASES)


def test_refusals_that_would_repeat_and_bad_verdicts_stop_at_once():
    client, asked = _client({"a": [(413, {"error": "70 cases; this service takes at most 64"}, {})]})
    with pytest.raises(SandboxError, match=r"http://a:8077 refused the program \(413: 70 cases"):
        client.score("print(2)", CASES)
    assert asked == ["a"]
    for bad in ({"reward": 1.0, "passed": 2, "total": 1, "reason": "passed"},  # more passed than run
                {"reward": "1", "passed": 1, "total": 1, "reason": "passed"},
                {**PASSED, "extra": 1}, [1, 1, 1, "passed"]):
        client, _ = _client({"a": [(200, bad, {})]})
        with pytest.raises(SandboxError, match="not a verdict"):
            client.score("print(2)", CASES)
    client, _ = _client({"a": [(200, {**PASSED, "total": 3, "passed": 3}, {})]})
    with pytest.raises(SandboxError, match="a verdict on 3 cases for 1 sent"):
        client.score("print(2)", CASES)


def test_admission_holds_concurrency_plus_queue_requests():
    a = Admission(concurrency=2, queue=1)
    assert [a.enter() for _ in range(4)] == [True, True, True, False]
    a.start()
    a.start()
    assert (a.running, a.waiting) == (2, 1)
    a.leave(started=True)
    assert a.enter() and not a.enter()
    a.leave(started=False)  # a request that never ran (the service stopping)
    assert (a.admitted, a.running, a.waiting) == (2, 1, 1)


def test_the_sandbox_package_imports_without_monarch_torch_or_the_model_code():
    """The sandbox is a service of its own: its modules load none of RL, Monarch, torch or the model."""
    import subprocess
    import sys

    probe = ("import sys, stalwart.sandbox.local, stalwart.sandbox.client, stalwart.sandbox.service, "
             "stalwart.cli.sandbox\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'monarch') "
             "or m.startswith(('stalwart.rl', 'stalwart.models', 'stalwart.train'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_sandbox_urls_take_a_json_list_or_the_comma_separated_form():
    from stalwart.config import ConfigError, load
    from stalwart.config.rl import RLConfig

    urls = ["http://10.0.0.1:8077", "http://10.0.0.2:8077"]
    for given in ('["http://10.0.0.1:8077", "http://10.0.0.2:8077"]', "http://10.0.0.1:8077,http://10.0.0.2:8077"):
        assert load(RLConfig, None, ["--workers.sandbox_urls", given]).workers.sandbox_urls == urls
    with pytest.raises(ConfigError, match=r"workers.sandbox_urls: .* is not a JSON list"):
        load(RLConfig, None, ["--workers.sandbox_urls", '["http://10.0.0.1:8077"'])


def test_a_batch_whose_service_dies_goes_to_another_with_every_verdict_once_and_the_dead_one_comes_back():
    """A dies mid-batch (its answer never comes): the batch goes to B, whose verdicts repeat the ids sent;
    A is left alone until its /health answers, then takes requests again. Per-host limits hold."""
    state = {"a_up": False, "posts": []}
    lock = threading.Lock()

    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.method == "GET":
            return httpx.Response(200 if state["a_up"] or host != "a" else 503, json={"status": "ok"})
        body = json.loads(request.content)
        with lock:
            state["posts"].append((host, len(body["programs"])))
        if host == "a" and not state["a_up"]:
            raise httpx.ReadError("connection reset by peer")  # died mid-batch
        return httpx.Response(200, json={"verdicts": [{"id": p["id"], **PASSED} for p in body["programs"]]})

    client = SandboxClient(["http://a:8077", "http://b:8077"], 10, health_s=0.05,
                           http=httpx.Client(transport=httpx.MockTransport(handle)), per_host=2)
    jobs = [("print(2)", CASES)] * 40
    assert client.score_many(jobs) == [Verdict(1.0, 1, 1, "passed")] * 40
    assert sum(n for host, n in state["posts"] if host == "b") == 40  # every program scored once, on b
    assert "http://a:8077" in client.down
    state["a_up"] = True
    import time

    time.sleep(0.06)
    state["posts"].clear()
    for _ in range(4):
        client.score_many([("print(2)", CASES)])
    assert {h for h, _ in state["posts"]} == {"a", "b"} and "http://a:8077" not in client.down
    # verdicts that do not repeat the ids sent are refused, never taken as another program's
    bad = SandboxClient(["http://c:8077"], 10, http=httpx.Client(transport=httpx.MockTransport(
        lambda r: httpx.Response(200, json={"verdicts": [{"id": "x", **PASSED}]}))))
    with pytest.raises(SandboxError, match="the verdicts answer programs"):
        bad.score_many([("print(2)", CASES)])
