"""Whether a failure came from inside the job or from outside it, for the crash-loop rule.

A crash loop is the job's own failure coming back. A fault from outside (an operator's or a chaos
loop's ``kill -9``, a SIGSTOP) says nothing about the job, however often it lands in the same place,
so it must not count toward ``fault.crash_loop_restarts`` (exit 76, "do not requeue"); the restart
budget still bounds it (exit 75, requeue).

From outside, as the supervisor sees it: the failed rank's process was killed by SIGKILL or found
stopped (SIGSTOP, a tracer) by the launcher itself; the rank left no exit record of its own error; no
fault of the job's own plan (``fault.inject``, which a worker sends itself) fired in the attempt; and,
for a SIGKILL, the kernel's OOM killer did not kill anything meanwhile. The OOM killer sends SIGKILL too,
and an OOM at the same point of every start-up is the job's own failure: its evidence is the kernel's
count of OOM kills (the job's memory cgroup, ``memory.events`` under cgroup v2 or ``memory.oom_control``
under v1, and the host's ``/proc/vmstat``), read when the attempt begins and when the failure is
handled. A count that rose (any OOM kill on the host counts, another job's too: it errs toward
a loop), or one that cannot be read at all, makes the SIGKILL the job's own.

``outside_fault`` is pure; ``oom_kills`` reads the counters (paths injectable for tests).
"""

from __future__ import annotations

import signal
from pathlib import Path

OomCounts = dict[str, int]


def _counter(path: Path, name: str) -> int | None:
    """The value of ``name`` in a ``key value`` per line file, None when unreadable."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def oom_kills(proc: Path = Path("/proc"), cgroup_fs: Path = Path("/sys/fs/cgroup")) -> OomCounts:
    """The kernel's OOM-kill counters this process can read: ``host`` (``/proc/vmstat``) and ``cgroup``
    (this process's memory cgroup and those below it, which hold its workers). Empty: none readable."""
    out: OomCounts = {}
    host = _counter(proc / "vmstat", "oom_kill")
    if host is not None:
        out["host"] = host
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "0::/path" (v2) or "4:memory:/path" (v1)
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        rel = parts[2].lstrip("/")
        if parts[0] == "0" and parts[1] == "":
            value = _counter(cgroup_fs / rel / "memory.events", "oom_kill")
        elif "memory" in parts[1].split(","):
            value = _counter(cgroup_fs / "memory" / rel / "memory.oom_control", "oom_kill")
        else:
            continue
        if value is not None:
            out["cgroup"] = out.get("cgroup", 0) + value
    return out


def oom_since(before: OomCounts, now: OomCounts) -> bool | None:
    """Whether the OOM killer killed anything between the two readings; None when no counter was read
    both times (unknown)."""
    common = [k for k in before if k in now]
    if not common:
        return None
    return any(now[k] > before[k] for k in common)


def outside_fault(kind: str, exitcode: int | None, own_record: bool, self_injected: bool, seen_stopped: bool,
                  oom: bool | None) -> bool:
    """Whether a failure came from outside the job (see the module's docstring): ``kind`` and ``exitcode``
    as the supervisor classified them, ``own_record`` the rank wrote an exit record of its own error,
    ``self_injected`` a fault of the job's own plan fired in the attempt, ``seen_stopped`` the launcher saw
    the rank's process stopped, ``oom`` the OOM killer killed something meanwhile (None: unknown)."""
    if own_record or self_injected:
        return False
    if kind == "unresponsive":
        return seen_stopped  # stopped by a signal; a heartbeat that merely went stale may be the job's own
    return kind == "signal" and exitcode == -signal.SIGKILL and oom is False
