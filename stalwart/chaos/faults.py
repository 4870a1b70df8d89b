"""The faults a cluster delivers, each sent from outside the job (no hook inside the process).

| kind | what is done | needs |
|---|---|---|
| ``kill`` | SIGKILL to one worker | - |
| ``stop`` | SIGSTOP to one worker (a hang: the heartbeat timeout finds it) | - |
| ``slow`` | one worker stopped and continued in a duty cycle (``SLOW_OFF_S`` of every ``SLOW_PERIOD_S``) for ``slow_s`` | - |
| ``disk_full`` | the tmpfs under ``<run>/checkpoints`` filled to the last block until a save fails (or the hold time), then freed; over once the next save is durable (or the hold time) | namespaces |
| ``partition`` | every TCP connection of one worker dropped (``tc``: its ports to a queue of length 0 on the job's own loopback) until the supervisor reports a failure (or the hold time), then healed | namespaces, 2+ ranks |
| ``corrupt_snapshot`` | once a disk checkpoint older than the newest snapshot exists: every worker frozen, a byte flipped in every in-memory snapshot file of the run (``/dev/shm``), one worker killed (one in every replica group: a group restarted alone takes its peers' memory and reads no snapshot): the restart must refuse the snapshots by their checksums and resume from disk | ``checkpoint.memory_interval``, ``checkpoint.interval`` |
| ``group_kill`` | SIGKILL to every rank of one replica group at once | ``fault.group_recovery`` |
| ``all_groups`` | SIGKILL to one rank of every replica group at once (the whole-job fallback) | ``fault.group_recovery`` |

With ``fault.group_recovery`` the disk filled is the target's group's (each group's checkpoints are a
tmpfs of their own) and the partition cuts one worker's connections, the cross-group exchange's among
them. Each ``fire`` returns when the fault's own action is over (a kill at once; a disk freed or a partition
healed after at most the hold time, a slowdown after its own) with the record of what was done.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.chaos.groups import GROUP_KINDS
from stalwart.paths import snapshot_step

if TYPE_CHECKING:  # chaos/job.py loads torch; `stalwart chaos` reads KINDS before it parses its flags
    from stalwart.chaos.job import Job

KINDS = ("kill", "stop", "slow", "disk_full", "partition", "corrupt_snapshot")
RESTARTING = ("kill", "stop", "partition", "corrupt_snapshot", *GROUP_KINDS)  # a group is restarted after these
SLOW_PERIOD_S, SLOW_OFF_S = 0.2, 0.1
_FILLER = ".chaos-filler"


def unavailable(kind: str, nproc: int, memory_interval: int, checkpoint_interval: int,
                namespaces: str | None, grouped: bool = False) -> str | None:
    """Why ``kind`` cannot run against this job (one line), or None. ``grouped``: a job of replica groups."""
    if kind in GROUP_KINDS and not grouped:
        return f"{kind} needs a job of replica groups (--fault.group_recovery true)"
    if kind in ("disk_full", "partition") and namespaces:
        return namespaces
    if kind == "partition" and nproc < 2:
        return "a partition needs 2 or more processes (--nproc-per-node)"
    if kind == "disk_full" and checkpoint_interval <= 0:
        return "a full disk during a save needs periodic saves (--checkpoint.interval > 0)"
    if kind == "corrupt_snapshot" and (memory_interval <= 0 or checkpoint_interval <= 0):
        return ("a corrupted memory snapshot needs snapshots and disk checkpoints to fall back to "
                "(--checkpoint.memory_interval > 0, --checkpoint.interval > 0)")
    return None


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _failure_after(job: Job, t: float) -> dict | None:
    """The first failure any group's supervisor detected at ``t`` or later."""
    return next((e for events in job.all_events().values() for e in events
                 if e.get("event") == "failure" and e.get("detect_time", 0) >= t), None)


def _event_after(job: Job, group: int, name: str, t: float) -> dict | None:
    return next((e for e in job.events(group) if e.get("event") == name and e.get("time", 0) >= t), None)


def fire(kind: str, job: Job, beats: dict[int, dict], victim: int, hit: list[int], hold_s: float,
         slow_s: float) -> dict:
    """Send fault ``kind`` aimed at the job's rank ``victim`` (killing ``hit``, the ranks it signals:
    ``Layout.hit``), whose heartbeats are in ``beats``."""
    pid, group = int(beats[victim]["pid"]), beats[victim].get("group", 0)
    rec = {"kind": kind, "rank": beats[victim].get("rank", victim), "pid": pid, "step": beats[victim].get("step"),
           "time": time.time()}
    if job.layout.grouped:
        rec.update(group=group, groups=sorted({beats[h]["group"] for h in hit}))
    if kind in ("kill", *GROUP_KINDS):
        pids = [int(beats[h]["pid"]) for h in hit]
        rec["sent"] = all([_signal(p, signal.SIGKILL) for p in pids])
        if len(pids) > 1:
            rec["pids"] = pids
    elif kind == "stop":
        rec["sent"] = _signal(pid, signal.SIGSTOP)
    elif kind == "slow":
        rec.update(_slow(job, pid, slow_s))
    elif kind == "disk_full":
        rec.update(_disk_full(job, group, rec["time"], hold_s))
    elif kind == "partition":
        rec.update(_partition(job, pid, rec["time"], hold_s))
    elif kind == "corrupt_snapshot":
        rec.update(_corrupt_snapshot(job, beats, [int(beats[h]["pid"]) for h in hit]))
    else:
        raise ValueError(kind)
    rec["until"] = time.time()
    return rec


def _slow(job: Job, pid: int, hold_s: float) -> dict:
    end, stopped_s = time.time() + hold_s, 0.0
    try:
        while time.time() < end and job.running():
            if not _signal(pid, signal.SIGSTOP):
                break
            time.sleep(SLOW_OFF_S)
            stopped_s += SLOW_OFF_S
            _signal(pid, signal.SIGCONT)
            time.sleep(SLOW_PERIOD_S - SLOW_OFF_S)
    finally:
        _signal(pid, signal.SIGCONT)
    return {"sent": True, "stopped_s": round(stopped_s, 2), "duty": SLOW_OFF_S / SLOW_PERIOD_S}


def _fill(path: Path) -> int:
    """Write zeros to ``path`` until the file system has no block left; the bytes written."""
    filled = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 1 << 12):  # megabytes, then the last pages
            chunk = bytes(size)
            while True:
                try:
                    n = os.write(fd, chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
                filled += n
                if n < size:
                    break
    finally:
        os.close(fd)
    return filled


def _disk_full(job: Job, group: int, t: float, hold_s: float) -> dict:
    filler = job.checkpoints(group) / _FILLER
    try:
        filled = _fill(filler)
        end = time.time() + hold_s
        while time.time() < end and job.running() and not _event_after(job, group, "checkpoint_failed", t):
            time.sleep(0.05)
    finally:
        filler.unlink(missing_ok=True)
    freed = time.time()
    end = freed + hold_s  # the next save, on a disk with room again, is the recovery: wait for it
    while time.time() < end and job.running() and not _event_after(job, group, "checkpoint_saved", freed):
        time.sleep(0.05)
    return {"sent": True, "filled_mb": round(filled / 2**20, 1), "freed": freed}


def _sockets(pid: int) -> set[str]:
    """Inodes of the sockets process ``pid`` holds open."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        pass
    return inodes


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _ports(pid: int) -> set[int]:
    """Local TCP ports of the sockets worker ``pid`` holds, less those it shares with its launcher (a
    worker forked from the launcher inherits the launcher's store sockets: they are not the worker's)."""
    inodes = _sockets(pid) - _sockets(_parent(pid))
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _partition(job: Job, pid: int, t: float, hold_s: float) -> dict:
    """Drop every packet to or from the worker's ports on the job's loopback (a queue of length 0)."""
    setup = [("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1"),
             ("class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit"),
             ("class", "add", "dev", "lo", "parent", "1:", "classid", "1:2", "htb", "rate", "100gbit"),
             ("qdisc", "add", "dev", "lo", "parent", "1:2", "handle", "20:", "pfifo", "limit", "0")]
    for args in setup:
        r = job.nsenter("tc", *args)
        if r.returncode != 0:
            job.nsenter("tc", "qdisc", "del", "dev", "lo", "root")
            return {"sent": False, "error": f"tc {' '.join(args)}: {r.stderr.strip()}"}
    cut: set[int] = set()
    try:
        end = time.time() + hold_s
        while time.time() < end and job.running() and not _failure_after(job, t):
            for port in _ports(pid) - cut:  # connections opened meanwhile are cut too
                for proto, match in (("ip", "ip"), ("ipv6", "ip6")):
                    for side in ("sport", "dport"):
                        job.nsenter("tc", "filter", "add", "dev", "lo", "parent", "1:", "protocol", proto, "prio",
                                    "1", "u32", "match", match, side, str(port), "0xffff", "flowid", "1:2")
                cut.add(port)
            time.sleep(0.1)
    finally:
        job.nsenter("tc", "qdisc", "del", "dev", "lo", "root")
    return {"sent": bool(cut), "ports_cut": len(cut)}


def _flip(path: Path) -> bool:
    """Flip one byte in the middle of a snapshot file, in place (its checksum covers it)."""
    try:
        with path.open("r+b") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size < 64:
                return False
            fh.seek(size // 2)
            b = fh.read(1)
            fh.seek(size // 2)
            fh.write(bytes([b[0] ^ 0xFF]))
        return True
    except OSError:
        return False


def _corrupt_snapshot(job: Job, beats: dict[int, dict], kill_pids: list[int]) -> dict:
    """Freeze every worker, corrupt every snapshot file (every group's), kill ``kill_pids``; the others stay
    stopped until their supervisor stops them (no snapshot can be taken between the corruption and the
    restart)."""
    for p in [int(b["pid"]) for b in beats.values()]:
        _signal(p, signal.SIGSTOP)
    steps, files = set(), 0
    for snaps in dict.fromkeys(job.snapshot_dirs):  # one directory once (an explicit memory_dir is shared)
        for path in sorted(snaps.glob("rank-*/*/step-*.snap")) if snaps else []:
            if _flip(path):
                files += 1
                steps.add(snapshot_step(path))
    sent = all([_signal(p, signal.SIGKILL) for p in kill_pids])
    out = {"sent": sent and files > 0, "files_corrupted": files, "snapshot_steps": sorted(s for s in steps if s)}
    if len(kill_pids) > 1:
        out["pids"] = kill_pids
    return out
