"""Recovery decisions of the single controller, as pure functions (no processes, clocks passed in).

A failure is attributed to an actor and a cause:

- ``killed``     the actor's process died (Monarch's supervision names the signal, e.g. ``Killed(sig=9)``)
- ``exception``  the endpoint raised; the detail is the remote traceback
- ``hang``       the command was still running after ``controller.step_timeout_s``
- ``peer``       the endpoint failed only because another actor left its collective (gloo reports the
                 lost connection or its own timeout): a consequence, not a cause

:func:`root_causes` picks the actors to replace; :func:`recovery_source` what state to restore.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from stalwart.ft.detect import PEER_LOST, PEER_TIMEOUT

_SIGNAL = re.compile(r"(?:Killed|Signaled)\(sig=(\d+)\)|signal (\d+)")


@dataclass(frozen=True)
class Failure:
    rank: int
    cause: str          # killed | exception | hang | peer
    detail: str         # the signal, the traceback, or what was still running
    detect_time: float  # unix time the controller learned of it
    fault_time: float   # the latest time the fault can have struck (the detection, or the hang's start)

    @property
    def root(self) -> bool:
        return self.cause != "peer"

    def describe(self) -> str:
        head = self.detail.strip().splitlines()[-1] if self.detail.strip() else ""
        return f"actor {self.rank}: {self.cause} ({head[:200]})"

    def as_event(self) -> dict:
        return {"rank": self.rank, "cause": self.cause, "detail": self.detail[-4000:],
                "detect_time": self.detect_time, "fault_time": self.fault_time}


def classify(rank: int, kind: str, text: str, now: float) -> Failure:
    """A failure from what the call raised: ``kind`` the exception's class name, ``text`` its message."""
    if kind == "SupervisionError" or "process this actor was running on failed" in text:
        m = _SIGNAL.search(text)
        return Failure(rank, "killed", signal_text(int(m.group(1) or m.group(2))) if m else text.strip()[-500:],
                       now, now)
    if PEER_LOST.search(text) or PEER_TIMEOUT.search(text):
        return Failure(rank, "peer", text.strip()[-2000:], now, now)
    return Failure(rank, "exception", text, now, now)


def signal_text(signum: int) -> str:
    """``killed by signal 9 (SIGKILL)``: one wording whether Monarch or /proc reported the death."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = "unknown"
    return f"killed by signal {signum} ({name})"


def classify_error(rank: int, exc: BaseException, now: float, what: str = "") -> Failure:
    """:func:`classify` of an exception from a Monarch future (an ``ActorError`` carries the remote
    traceback as text)."""
    text = getattr(exc, "exception_formatted", None) or str(exc)
    return classify(rank, type(exc).__name__, text, now)


def hang_bound(step_timeout_s: float) -> float:
    """How long the controller waits for a step before it names the actors still running as hung. The
    actors' collectives time out after ``step_timeout_s``, so by then an actor blocked on a hung peer
    has failed as a peer; the margin lets that report arrive first."""
    return step_timeout_s + max(2.0, 0.25 * step_timeout_s)


def root_causes(failures: list[Failure]) -> list[Failure]:
    """The actors whose failure started it: every non-peer failure; if all are peer failures (each
    saw the other go), all of them."""
    roots = [f for f in failures if f.root]
    return roots or list(failures)


def fault_origin(root: Failure, failures: list[Failure], fired: list[dict], step: int,
                 seen: set[str]) -> tuple[float, str | None]:
    """When the fault struck, and which injected fault it was (``fault.inject``), if any: the fired
    record of this rank and step not attributed before, else the earliest sign of the failure (a peer
    may have seen the lost connection before Monarch reported the death)."""
    for rec in fired:
        if rec.get("rank") == root.rank and rec.get("step") == step and rec.get("id") not in seen:
            seen.add(rec["id"])
            return float(rec["time"]), str(rec.get("kind"))
    return min([root.fault_time] + [f.detect_time for f in failures]), None


def recovery_source(recover_from: str, memory_interval: int) -> str:
    """What a recovery restores before replaying the journal: the in-memory snapshots when they are
    kept and wanted, else the newest disk checkpoint (``disk``); an actor with neither keeps its
    seeded initialisation and the journal is replayed from the session's start."""
    return "memory" if recover_from == "memory" and memory_interval > 0 else "disk"


def keeps_survivors(source: str) -> bool:
    """Whether survivors keep their processes: with in-memory snapshots they do (and rebuild only
    their process group); a disk restore respawns every actor, as an SPMD restart does."""
    return source == "memory"
