"""One run per run directory: an exclusive lock on ``<run>/run.lock`` held for the life of the run.

The lock is an ``flock`` on the file, so the kernel releases it when its holder dies, however it dies;
the file's content names the holder (host, PID, start time, job) for the message a second run prints.
Who holds it: the launcher (``stalwart train`` with workers, or the single-host agent) for its whole
job, restarts included; otherwise the one training process, or global rank 0 under plain ``torchrun``.
A lock whose holder is gone is taken over with a warning; one held by an earlier attempt of the same
job (``job`` equal, e.g. torchrun's run id) is waited for briefly, since that attempt is being torn down.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from stalwart.atomic import output_dir
from stalwart.errors import UserError
from stalwart.paths import RunPaths
from stalwart.procs import pid_alive


# Set by a launcher that holds the lock for its workers (the value is its PID; a worker trusts it only
# when that PID is its parent), and by every Stalwart launcher for the parent check of its workers.
LOCK_HOLDER_ENV = "STALWART_LOCK_HOLDER"
LAUNCHER_PID_ENV = "STALWART_LAUNCHER_PID"


class RunDirLocked(UserError):
    """Another live run holds this run directory."""


def describe_holder(rec: dict) -> str:
    started = rec.get("start")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"host {rec.get('host', '?')}, PID {rec.get('pid', '?')}, started {when}"


class RunLock:
    """``with RunLock(paths, job=...):`` holds the run directory; ``RunDirLocked`` if another run does."""

    def __init__(self, paths: RunPaths, job: str = "", wait_same_job_s: float = 30.0) -> None:
        self.paths, self.job, self.wait_same_job_s = paths, job, wait_same_job_s
        self.path = paths.lock
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _read(self, fd: int | None = None) -> dict:
        try:
            if fd is None:
                text = self.path.read_text()
            else:
                os.lseek(fd, 0, os.SEEK_SET)
                text = os.read(fd, 65536).decode("utf-8", "replace")
            rec = json.loads(text) if text.strip() else {}
            return rec if isinstance(rec, dict) else {}
        except (OSError, ValueError):
            return {}

    def acquire(self) -> None:
        output_dir(self.paths.root, "run.dir")
        deadline = time.monotonic() + self.wait_same_job_s
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                holder = self._read()
                if self.job and holder.get("job") == self.job and time.monotonic() < deadline:
                    time.sleep(0.1)  # an earlier attempt of this job is still being torn down
                    continue
                raise RunDirLocked(f"run directory {self.paths.root} is in use by another run ({describe_holder(holder)}"
                                   f"); wait for it to end, stop it, or choose another --run.dir") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder removed the file between our open and our lock
                os.close(fd)
                continue
            break
        previous = self._read(fd)
        if previous and previous.get("pid") and not (self.job and previous.get("job") == self.job):
            gone = previous.get("host") != socket.gethostname() or not pid_alive(int(previous["pid"]))
            print(f"warning: taking over the lock of run directory {self.paths.root} left by a run that "
                  f"{'is gone' if gone else 'released it'} ({describe_holder(previous)})", file=sys.stderr, flush=True)
        rec = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.time(), "job": self.job,
               "argv": sys.argv[:8]}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(rec).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        os.close(self._fd)
        self._fd = None


def drop_unowned_snapshots(paths: RunPaths, snapshot_dir: Path | None) -> bool:
    """Before a job's first attempt: a run directory that never trained (no ``metrics.jsonl``) owns no
    in-memory snapshot, so what ``/dev/shm`` holds under its key was left by a deleted run of the same
    path (killed, so never cleared) and must not be resumed: remove it, and say whether there was one.
    Only the run's own key (``paths.snapshots()``) is touched, never an explicit ``checkpoint.memory_dir``.
    Called by whoever holds the job (the launcher's supervisor on each host, the controller, a lone
    worker), before any worker can look at the snapshots; never on a restart, whose snapshots are its own."""
    if snapshot_dir is None or Path(snapshot_dir) != paths.snapshots() or paths.metrics.exists():
        return False
    existed = Path(snapshot_dir).exists()
    shutil.rmtree(snapshot_dir, ignore_errors=True)
    return existed


def held_by_parent() -> bool:
    """True in a worker whose parent launcher holds the run directory's lock for it."""
    return os.environ.get(LOCK_HOLDER_ENV, "") == str(os.getppid())


def under_stalwart_launcher() -> bool:
    """True in a worker started by Stalwart's launcher (its supervisor reports the workers' errors)."""
    return os.environ.get(LAUNCHER_PID_ENV, "") == str(os.getppid())
