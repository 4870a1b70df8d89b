"""The replicas behind the router (serve/router.py) and their supervision.

``Fleet``: their processes, and how to start one again; ``wait_for_ports``: until each serves.
``Replicas``: what the router knows of each (requests in flight, up or down, starting again, the weights it
serves), lists changed in place that the router's handlers share. ``supervision``: the probe, every
``PROBE_INTERVAL_S``, that keeps those current: a replica is down from the moment its ``/health`` is not
ok, and up again once it is; one whose process exited is started again (and given the weights the others
serve before it rejoins), one whose ``/health`` stays failed (its engine dead or stuck) for
``RESTART_AFTER_S`` is killed and started again; with cache-aware routing, what each one's cache holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import httpx

from stalwart.errors import UserError
from stalwart.serve.prefix import Policy

PROBE_INTERVAL_S = 1.0
RESTART_AFTER_S = 5.0  # a live replica whose /health fails this long is killed and started again
UNREACHABLE_AFTER_S = 30.0  # the same for one whose /health does not answer at all
RECOVERING_LIMIT_S = 120.0  # the same for one whose launcher is starting a process of it again


@dataclass
class Fleet:
    """The replica processes behind the router; ``start(i)`` starts replica ``i`` (again), writing its
    port to ``files[i]``. ``procs`` is updated in place, so whoever stops them at exit stops the new ones.
    ``weights[i]``: where replica ``i`` records the weights it applied (serve/applied.py)."""

    procs: list[subprocess.Popen]
    files: list[Path]
    start: Callable[[int], subprocess.Popen]
    weights: list[Path] | None = None
    kv_dir: Path | None = None  # where prefill replicas leave hand-offs (serve/disagg.py)


class Replicas:
    """What the router knows of each of ``n`` replicas: one entry per replica in each list."""

    def __init__(self, n: int) -> None:
        self.in_flight, self.served, self.restarts = [0] * n, [0] * n, [0] * n
        self.up = [True] * n
        self.failing_since: list[float | None] = [None] * n  # when /health last turned from ok
        self.starting = [False] * n  # restarted, its port not known yet (or its weights not caught up)
        self.draining = [False] * n  # finishing its requests before a weight update: takes no new ones
        self.last_update: dict = {}  # the last weight update every replica took, for a replica started again
        self.weights_seen: list = [None] * n  # the weight version each replica's /health last named


def supervision(replicas: Replicas, backends: list[str], fleet: Fleet | None, client: httpx.AsyncClient,
                policy: Policy, routed: dict, cache_aware: bool
                ) -> tuple[Callable[[int], Awaitable[bool]], Callable[[], Awaitable[None]]]:
    """``check(i)``: probe replica ``i``'s ``/health`` (and kill it if it has failed too long); whether it is
    up. ``probe()``: supervise, check and (cache-aware) learn the caches of every replica, forever.
    ``backends``: their URLs (updated in place when one restarts on a new port)."""
    n = len(backends)
    up, starting, failing_since, restarts = replicas.up, replicas.starting, replicas.failing_since, replicas.restarts
    last_update, weights_seen = replicas.last_update, replicas.weights_seen

    async def check(i: int) -> bool:
        if starting[i]:
            return False
        try:
            r = await client.get(backends[i] + "/health", timeout=10.0)
            up[i] = r.status_code == 200
            reachable = True
            weights_seen[i] = r.json().get("weight_version") if up[i] else None
        except (httpx.HTTPError, ValueError):
            up[i], reachable, weights_seen[i] = False, False, None
        now = time.monotonic()
        failing_since[i] = None if up[i] else failing_since[i] or now
        # A replica whose launcher is starting a lost process again says so (503 with Retry-After).
        limit = (UNREACHABLE_AFTER_S if not reachable else RECOVERING_LIMIT_S if "retry-after" in r.headers
                 else RESTART_AFTER_S)
        if fleet is not None and not up[i] and fleet.procs[i].poll() is None and now - failing_since[i] > limit:
            why = r.json().get("error", r.status_code) if reachable else "its /health does not answer"
            print(f"stalwart serve: replica {i} is not serving ({why}); restarting it", file=sys.stderr, flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(fleet.procs[i].pid, signal.SIGKILL)  # its own process group (cli/serve.py)
        return up[i]

    async def supervise(i: int) -> None:
        """Start replica ``i`` again if its process exited; take its new port once it serves, after giving
        it the weights the others serve (the last update), so every replica serves one version."""
        if fleet is None:
            return
        proc = fleet.procs[i]
        if not starting[i] and proc.poll() is not None:
            print(f"stalwart serve: replica {i} exited with code {proc.returncode}; starting it again",
                  file=sys.stderr, flush=True)
            up[i], starting[i] = False, True
            fleet.files[i].unlink(missing_ok=True)
            fleet.procs[i] = fleet.start(i)
            restarts[i] += 1
            policy.view.forget(i)
        elif starting[i] and fleet.files[i].is_file():
            url = f"http://127.0.0.1:{int(fleet.files[i].read_text())}"
            if last_update:
                try:
                    # Started again, it serves the weights it last applied (its record): maybe these.
                    served = (await client.get(url + "/health", timeout=10.0)).json().get("weight_version")
                    r = None if served == last_update["version"] else await client.post(
                        url + "/v1/weights", json=last_update, headers=routed)
                except (httpx.HTTPError, ValueError):
                    return  # not answering yet (or gone again): the next probe sees
                if r is not None and r.status_code != 200:
                    print(f"stalwart serve: replica {i} could not take the weights the others serve "
                          f"({r.text[:300]}); restarting it", file=sys.stderr, flush=True)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(fleet.procs[i].pid, signal.SIGKILL)
                    starting[i] = False
                    return
            backends[i] = url
            starting[i], failing_since[i] = False, None

    async def cached(i: int) -> None:
        """What replica ``i``'s cache holds (serve/prefix.py)."""
        try:
            r = await client.get(backends[i] + "/v1/cache", headers=routed, timeout=10.0)
            got = r.json()
            policy.view.block_size = int(got["block_size"])
            policy.view.reported(i, {bytes.fromhex(d) for d in got["digests"]})
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass  # not answering: its view stays as it was until it does

    async def probe() -> None:
        while True:
            for i in range(n):
                await supervise(i)
            await asyncio.gather(*(check(i) for i in range(n)))
            if cache_aware:
                await asyncio.gather(*(cached(i) for i in range(n) if up[i]))
            await asyncio.sleep(PROBE_INTERVAL_S)

    return check, probe


def wait_for_ports(procs: list[subprocess.Popen], files: list[Path], timeout_s: float = 300.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if p.poll() is not None:
                raise UserError(f"replica {i} exited with code {p.returncode} before serving (see its message above)")
        if all(f.is_file() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.2)
    raise UserError(f"replicas did not start within {timeout_s:.0f} s")
