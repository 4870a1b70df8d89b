"""What the launcher sees of its own worker processes, first-hand: stopped, and which failed first (alive:
``stalwart.procs.pid_alive``)."""

from __future__ import annotations

import signal

from stalwart.ft.records import read_exit_records
from stalwart.paths import RunPaths


def stopped(pid: int) -> bool:
    """Whether a process is stopped by a signal (SIGSTOP, SIGTSTP) or a tracer."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


_STOPPED_BY_US = (-signal.SIGTERM, -signal.SIGKILL)  # how torch (and the watchdog) stop the survivors


def root_cause(failures: dict, paths: RunPaths, since: float, injected: list[dict]) -> int:
    """The failed rank that caused the others to fail, from ``failures`` (rank -> exit code, or torch's
    failure records): an injected fault's rank, else one killed by a signal other than the SIGTERM torch
    sends the survivors, else the earliest to record its exit (``<run>/ft/exit``: crashes and user
    errors), else one that exited by itself, else the lowest. Given the ranks the agent saw failed before
    it stopped any, that is the choice among them only, except that ranks which only saw a peer fail
    point to the rank whose own record they saw (see ``awaiting_cause``)."""
    codes = {r: getattr(f, "exitcode", f) for r, f in failures.items()}
    if not codes:
        return -1
    fired = [f for f in injected if f.get("rank") in codes]
    if fired:
        return max(fired, key=lambda f: f["time"])["rank"]
    signalled = [r for r, c in codes.items() if c is not None and c < 0 and c != -signal.SIGTERM]
    if signalled:
        return min(signalled)
    records = read_exit_records(paths, since)
    exits = {r: rec for r, rec in records.items() if r in codes}
    if exits and all(rec.get("peer") for rec in exits.values()):
        # Each of these stopped because another rank failed: that rank's own record names the cause,
        # though its process may still be exiting (ranks that agree on an error leave together).
        exits = {r: rec for r, rec in records.items() if not rec.get("peer")} or exits
    if exits:  # a rank that stopped only because a peer failed is never the cause
        return min(exits, key=lambda r: (bool(exits[r].get("peer")), exits[r]["time"]))
    own = [r for r, c in codes.items() if c not in _STOPPED_BY_US]
    return min(own or codes)


def awaiting_cause(failed: dict[int, int], paths: RunPaths, since: float) -> bool:
    """Whether every rank in ``failed`` (rank -> exit code) left because a peer failed: ranks that agree
    on an error leave together, and the one whose own error it is may still be on its way out, worth a
    moment's wait before the agent stops the group (and sees the wrong rank first)."""
    if not failed:  # the healthy path of every monitor tick: no files read
        return False
    records = read_exit_records(paths, since)
    return all(records.get(r, {}).get("peer") for r in failed)
