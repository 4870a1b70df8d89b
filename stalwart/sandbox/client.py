"""A fleet of sandbox services (``service.py``) as one scorer: the same ``score(source, cases) -> Verdict``
and ``score_many(jobs)`` as a local ``Sandbox`` (``score_many`` sends up to 32 programs per request: one
sandbox there), run by whichever listed service takes it.

Spreading: a request goes to the service with the fewest requests of this client in flight (ties in
turn, round-robin over the calls), never to one already holding ``per_host`` of them (a per-host
concurrency limit: the calls beyond wait). A service that is busy (429, 503: for the Retry-After it
asked, else a backoff) or failing (5xx) is skipped for the next one; one that is unreachable or dies
mid-request (reset, timed out) is *down*: skipped until its ``GET /health`` answers again, asked at
most every ``health_s``; the request it held goes to another service. Every program of a batch carries
an id, which the service's verdict repeats: a batch's verdicts are accepted once, from one answer, each
checked against its program, so a service dying mid-batch loses no verdict and counts none twice. Once
every service was tried the client waits (the longest Retry-After a busy one asked for, otherwise a
backoff that doubles from 0.1 s up to 2 s, both with jitter) and goes round again, until ``retry_s``
has passed: then the run stops with one line naming every service and what it last answered. A
request the service refuses as malformed (400, 413) is not retried: it would be refused again. JSON in,
JSON out; nothing is unpickled.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from stalwart.sandbox.local import BATCH, Case, SandboxError, Verdict

BACKOFF_S = (0.1, 2.0)  # first and largest wait between rounds over every service
HEALTH_TIMEOUT_S = 2.0  # a down service's /health must answer within this


class SandboxClient:
    """Scores programs on sandbox services; safe to share between threads."""

    def __init__(self, urls: list[str], retry_s: float, http: httpx.Client | None = None, per_host: int = 8,
                 health_s: float = 1.0) -> None:
        if not urls:
            raise SandboxError("workers.sandbox_urls: no sandbox service listed")
        self.urls = [u.rstrip("/") for u in urls]
        self.retry_s, self.per_host, self.health_s = retry_s, per_host, health_s
        # A request may wait in a service's queue behind other programs: the read bound is the whole budget.
        self.http = http or httpx.Client(timeout=httpx.Timeout(retry_s, connect=min(5.0, retry_s)),
                                         transport=transport(urls, per_host))
        self.inflight = dict.fromkeys(self.urls, 0)
        self.down: dict[str, float] = {}  # url -> when its health may be asked next
        self._turn = itertools.count()
        self._ids = itertools.count()
        self._cond = threading.Condition()

    def score_many(self, jobs: list[tuple[str, list[Case]]]) -> list[Verdict]:
        """`score` of each job, in order: up to BATCH programs per request, which the service runs one
        after another in one sandbox; each program carries an id its verdict must repeat."""
        verdicts: list[Verdict] = []
        for k in range(0, len(jobs), BATCH):
            part = jobs[k:k + BATCH]
            ids = [f"{os.getpid()}-{next(self._ids)}" for _ in part]
            body = {"programs": [{"id": i, **_job(source, cases)} for i, (source, cases) in zip(ids, part)]}
            verdicts += self._post(body, lambda data, url, part=part, ids=ids: _verdicts(data, url, part, ids))
        return verdicts

    def score(self, source: str, cases: list[Case]) -> Verdict:
        return self._post(_job(source, cases), lambda data, url: _verdicts({"verdicts": [data]}, url,
                                                                          [(source, cases)])[0])

    def _order(self) -> list[str]:
        """The services to try, best first: up ones by fewest in flight (ties in turn), then down ones."""
        first = next(self._turn)
        turn = [self.urls[(first + k) % len(self.urls)] for k in range(len(self.urls))]
        return sorted(turn, key=lambda u: (u in self.down, self.inflight[u]))

    def _post(self, body: dict, parse: Callable[[object, str], Any]) -> Any:
        """POST ``body`` to the services until one answers (``parse`` of its JSON), as the module's
        docstring says."""
        deadline = time.monotonic() + self.retry_s
        last: dict[str, str] = {}
        for rounds in itertools.count(1):
            self._revive()
            asked = 0.0  # the longest Retry-After of this round
            for url in self._order():
                if not self._enter(url, deadline, last):
                    continue
                try:
                    got = self._try(url, body, parse, last)
                finally:
                    with self._cond:
                        self.inflight[url] -= 1
                        self._cond.notify_all()
                if not isinstance(got, float):
                    return got
                asked = max(asked, got)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            backoff = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (rounds - 1))
            wait = asked * random.uniform(1.0, 1.5) if asked else backoff * random.uniform(0.5, 1.0)
            time.sleep(min(wait, left))
        seen = "; ".join(f"{u}: {why}" for u, why in last.items())
        raise SandboxError(f"workers.sandbox_urls: no sandbox service scored a program within "
                           f"workers.sandbox_retry_s ({self.retry_s:g} s) ({seen})")

    def _enter(self, url: str, deadline: float, last: dict[str, str]) -> bool:
        """Take a place at ``url`` (waiting while it holds ``per_host`` requests of this client), unless it
        is down."""
        if url in self.down:
            return False
        with self._cond:
            while self.inflight[url] >= self.per_host:
                left = deadline - time.monotonic()
                if left <= 0:
                    last[url] = f"{self.per_host} requests of this client in flight (per_host)"
                    return False
                self._cond.wait(min(left, 1.0))
            self.inflight[url] += 1
        return True

    def _revive(self) -> None:
        """Ask each down service whose time has come for its health: back in the rotation if it answers."""
        now = time.monotonic()
        with self._cond:
            due = [u for u, at in self.down.items() if at <= now]
            for url in due:  # this thread asks; the others skip it meanwhile instead of asking too
                self.down[url] = now + self.health_s + HEALTH_TIMEOUT_S
        for url in due:
            if self._healthy(url):
                with self._cond:
                    self.down.pop(url, None)

    def _healthy(self, url: str) -> bool:
        """Ask a down service's ``/health``: whether it answers ok (else asked again after health_s)."""
        try:
            ok = self.http.get(f"{url}/health", timeout=min(HEALTH_TIMEOUT_S, self.health_s * 2)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            with self._cond:
                self.down[url] = time.monotonic() + self.health_s
        return ok

    def _try(self, url: str, body: dict, parse: Callable[[object, str], Any], last: dict[str, str]) -> Any:
        """One request to ``url``: its parsed answer, or the wait it asked for (a float, 0: none) after
        recording in ``last`` why it gave none. A refusal that would repeat is raised."""
        try:
            resp = self.http.post(f"{url}/v1/score", json=body)
        except httpx.HTTPError as e:  # unreachable, reset, timed out: down until its health is back
            last[url] = f"{type(e).__name__}: {e}"[:200]
            with self._cond:
                self.down[url] = time.monotonic() + self.health_s
            return 0.0
        if resp.status_code == 200:
            try:
                data = resp.json()
            except ValueError:
                raise SandboxError(f"sandbox service {url}: the answer is not JSON") from None
            return parse(data, url)
        message = _message(resp)
        if resp.status_code in (400, 404, 405, 413, 422):
            raise SandboxError(f"sandbox service {url} refused the program ({resp.status_code}: {message})")
        last[url] = f"{resp.status_code} {message}"[:200]
        try:
            return max(0.0, float(resp.headers.get("retry-after", 0)))
        except ValueError:
            return 0.0


def transport(urls: list[str], per_host: int) -> httpx.HTTPTransport:
    """The connection pool a client over ``urls`` needs: ``per_host`` requests to each at once, and room
    for health checks."""
    return httpx.HTTPTransport(limits=httpx.Limits(max_connections=per_host * len(urls) + 8))


def _job(source: str, cases: list[Case]) -> dict:
    return {"program": source, "cases": [{"input": c.input, "output": c.output} for c in cases]}


def _verdicts(data: object, url: str, jobs: list[tuple[str, list[Case]]], ids: list[str] | None = None) -> list[Verdict]:
    """The verdicts of a batch answer ({"verdicts": [...]}), each checked against the case count and the
    id of the program it answers."""
    if not (isinstance(data, dict) and isinstance(data.get("verdicts"), list) and len(data["verdicts"]) == len(jobs)):
        raise SandboxError(f"sandbox service {url}: not {len(jobs)} verdicts ({str(data)[:200]})")
    answers = data["verdicts"]
    if ids is not None:
        got = [v.get("id") if isinstance(v, dict) else None for v in answers]
        if got != ids:
            raise SandboxError(f"sandbox service {url}: the verdicts answer programs {got[:4]}..., not those sent "
                               f"({ids[:4]}...)")
        answers = [{k: x for k, x in v.items() if k != "id"} for v in answers]
    verdicts = [Verdict.from_dict(v, f"sandbox service {url}") for v in answers]
    for v, (_, cases) in zip(verdicts, jobs):
        if v.total != len(cases):
            raise SandboxError(f"sandbox service {url}: a verdict on {v.total} cases for {len(cases)} sent")
    return verdicts


def open_sandbox(cfg: object, urls: list[str] | None, retry_s: float) -> object:
    """Where a worker runs programs: the sandbox services ``urls`` (this client) when any are listed, else
    its own sandboxes under ``cfg`` (a ``SandboxConfig``); both answer ``score(source, cases)``."""
    if urls:
        return SandboxClient(urls, retry_s)
    from stalwart.sandbox.local import Sandbox

    return Sandbox(cfg)


def _message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
        return str(data.get("error", data)) if isinstance(data, dict) else str(data)
    except ValueError:
        return resp.text[:200]
