"""Process plumbing shared by training workers and serving replicas."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send this process ``sig`` when its parent exits, however the parent exits."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig, 0, 0, 0)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host: it exists (one we may not signal counts) and is not a
    zombie (exited, not yet reaped by its parent: dead for every purpose here)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (not Linux), or it left between the two looks
        return True


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, theirs, ...), from /proc; zombies are not counted."""
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X"):
            parents[int(d)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier and c not in out}
        out |= frontier
    return out


def name_process(name: str) -> None:
    """Set this process's name as ``ps``, ``top`` and /proc/PID/comm show it (Linux; at most 15 bytes):
    forked workers otherwise all carry their launcher's."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_name = 15
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
