"""The reward worker actor: scores generated programs against hidden test cases in the sandbox.

One actor process runs up to ``threads`` sandboxes at once (each sandbox is its own bubblewrap process
tree running a share of the programs one after another, so threads here only wait), or, with ``workers.sandbox_urls``, has that many programs at once
scored by the sandbox services. A program that hangs, crashes or misbehaves costs its own reward
(0, with the sandbox's reason); the worker itself never runs any of it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from monarch.actor import Actor, endpoint


class RewardActor(Actor):
    def __init__(self) -> None:
        self.sandbox = None
        self.pool: ThreadPoolExecutor | None = None
        self.threads = 1
        self.busy_s = 0.0

    @endpoint
    def warm(self) -> int:
        import stalwart.sandbox.local  # noqa: F401

        return os.getpid()

    @endpoint
    def setup(self, sandbox_cfg: Any, threads: int, urls: list[str] | None = None, retry_s: float = 60.0) -> int:
        """Run programs in this process's own sandboxes, or send them to the sandbox services ``urls``
        (``sandbox_client.SandboxClient``: the same verdicts, the services' limits)."""
        from stalwart.sandbox.client import open_sandbox

        self.sandbox = open_sandbox(sandbox_cfg, urls, retry_s)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="sandbox")
        self.threads = threads
        return os.getpid()

    @endpoint
    def score(self, jobs: list[tuple[str, list[tuple[str, str]]]]) -> dict[str, Any]:
        """jobs: (program source, [(input, expected output), ...]) -> one verdict per job, in order:
        (reward, passed, total, reason)."""
        from stalwart.sandbox.local import Case, score_spread

        t0 = time.perf_counter()
        cased = [(source, [Case(i, o) for i, o in cases]) for source, cases in jobs]
        verdicts = score_spread(self.sandbox, self.pool, cased, self.threads)
        seconds = time.perf_counter() - t0
        self.busy_s += seconds
        return {"verdicts": [(v.reward, v.passed, v.total, v.reason) for v in verdicts], "seconds": seconds,
                "pid": os.getpid()}
