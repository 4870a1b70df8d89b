"""A reward worker's side of the sandbox service (``service.py``): the same
``score(source, cases) -> Verdict`` and ``score_many(jobs)`` as a local ``Sandbox``, run by whichever
listed service takes it (``score_many`` sends up to 32 programs per request: one sandbox there).

Requests start at the services in turn (round-robin over the calls, so threads and workers spread
out). A service that is busy (429, 503), failing (5xx) or unreachable is skipped for the next one; once
every service was tried the client waits, the longest Retry-After a busy one asked for, otherwise a
backoff that doubles from 0.1 s up to 2 s (both with jitter, so many clients do not return together), and
goes round again, until ``retry_s`` has passed: then the run stops with one line naming every service
and what it last answered. A request the service refuses as malformed (400, 413) is not retried:
it would be refused again. JSON in, JSON out; nothing is unpickled.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from stalwart.sandbox.local import BATCH, Case, SandboxError, Verdict

BACKOFF_S = (0.1, 2.0)  # first and largest wait between rounds over every service


class SandboxClient:
    """Scores programs on sandbox services; safe to share between threads."""

    def __init__(self, urls: list[str], retry_s: float, http: httpx.Client | None = None) -> None:
        if not urls:
            raise SandboxError("workers.sandbox_urls: no sandbox service listed")
        self.urls = [u.rstrip("/") for u in urls]
        self.retry_s = retry_s
        # A request may wait in a service's queue behind other programs: the read bound is the whole budget.
        self.http = http or httpx.Client(timeout=httpx.Timeout(retry_s, connect=min(5.0, retry_s)))
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def score_many(self, jobs: list[tuple[str, list[Case]]]) -> list[Verdict]:
        """`score` of each job, in order: up to BATCH programs per request, which the service runs one
        after another in one sandbox."""
        verdicts: list[Verdict] = []
        for k in range(0, len(jobs), BATCH):
            part = jobs[k:k + BATCH]
            body = {"programs": [_job(source, cases) for source, cases in part]}
            verdicts += self._post(body, lambda data, url, part=part: _verdicts(data, url, part))
        return verdicts

    def score(self, source: str, cases: list[Case]) -> Verdict:
        return self._post(_job(source, cases), lambda data, url: _verdicts({"verdicts": [data]}, url,
                                                                          [(source, cases)])[0])

    def _post(self, body: dict, parse: Callable[[object, str], Any]) -> Any:
        """POST ``body`` to the services in turn until one answers (``parse`` of its JSON), as the
        module's docstring says."""
        with self._lock:
            first = next(self._turn)
        deadline = time.monotonic() + self.retry_s
        last: dict[str, str] = {}
        asked = 0.0  # the longest Retry-After of this round
        for attempt in itertools.count():
            url = self.urls[(first + attempt) % len(self.urls)]
            got = self._try(url, body, parse, last)
            if not isinstance(got, float):
                return got
            asked = max(asked, got)
            if (attempt + 1) % len(self.urls) == 0:  # every service tried this round: wait, then again
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                rounds = (attempt + 1) // len(self.urls)
                backoff = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (rounds - 1))
                wait = asked * random.uniform(1.0, 1.5) if asked else backoff * random.uniform(0.5, 1.0)
                time.sleep(min(wait, left))
                asked = 0.0
        seen = "; ".join(f"{u}: {why}" for u, why in last.items())
        raise SandboxError(f"workers.sandbox_urls: no sandbox service scored a program within "
                           f"workers.sandbox_retry_s ({self.retry_s:g} s) ({seen})")

    def _try(self, url: str, body: dict, parse: Callable[[object, str], Any], last: dict[str, str]) -> Any:
        """One request to ``url``: its parsed answer, or the wait it asked for (a float, 0: none) after
        recording in ``last`` why it gave none. A refusal that would repeat is raised."""
        try:
            resp = self.http.post(f"{url}/v1/score", json=body)
        except httpx.HTTPError as e:  # unreachable, reset, timed out: the next service may answer
            last[url] = f"{type(e).__name__}: {e}"[:200]
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


def _job(source: str, cases: list[Case]) -> dict:
    return {"program": source, "cases": [{"input": c.input, "output": c.output} for c in cases]}


def _verdicts(data: object, url: str, jobs: list[tuple[str, list[Case]]]) -> list[Verdict]:
    """The verdicts of a batch answer ({"verdicts": [...]}), each checked against the cases sent."""
    if not (isinstance(data, dict) and isinstance(data.get("verdicts"), list) and len(data["verdicts"]) == len(jobs)):
        raise SandboxError(f"sandbox service {url}: not {len(jobs)} verdicts ({str(data)[:200]})")
    verdicts = [Verdict.from_dict(v, f"sandbox service {url}") for v in data["verdicts"]]
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
