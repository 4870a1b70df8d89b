"""The job under chaos: one ``stalwart train`` command, seen and touched only from outside.

With root (``unshare -m -n`` works) the command runs in a private mount and network namespace of its
own: the run's ``checkpoints`` directory is a small tmpfs there (a disk that can be filled) and the
ranks talk over a loopback of their own (one rank's connections can be cut with ``tc`` without
touching any other process on the machine). The namespaces die with the job; the checkpoints are
copied back onto the real directory when the command ends. Without root the command runs as is and
the kinds that need the namespaces are skipped.

Everything the drill knows about the job it reads from files the job writes anyway: heartbeats
(``<run>/ft/heartbeat``: each rank's pid, attempt, phase and step), ``events.jsonl``, the checkpoint
and snapshot directories.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from stalwart.ft.records import read_heartbeats
from stalwart.ft.supervisor import newest_state_step
from stalwart.paths import RunPaths
from stalwart.procs import die_with_parent, pid_alive

# Runs inside the namespaces: the tmpfs, loopback up, the command; then the checkpoints go back to disk.
_WRAPPER = """
set -u
ck="$1"; mb="$2"; shift 2
mount -t tmpfs -o "size=${mb}m" stalwart-chaos "$ck" || exit 90
ip link set lo up || exit 91
"$@" &
child=$!
trap 'kill -TERM $child 2>/dev/null' TERM INT
wait $child; rc=$?
while kill -0 $child 2>/dev/null; do wait $child; rc=$?; done
keep="$ck.chaos-keep"
rm -rf "$keep"; mkdir "$keep"; rm -f "$ck"/.chaos-filler*; cp -a "$ck"/. "$keep"/
umount "$ck" && cp -a "$keep"/. "$ck"/ && rm -rf "$keep"
exit $rc
"""


def namespaces_unavailable() -> str | None:
    """None when the job can run in private mount + network namespaces here, else why not (one line)."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (util-linux, iproute2)"
    if os.geteuid() != 0:
        return "a private mount and network namespace for the job needs root"
    probe = subprocess.run(["unshare", "-m", "-n", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt && ip link set lo up && tc qdisc show dev lo"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"'unshare -m -n' failed here: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


class Job:
    """``stalwart train ARGV`` started in the background (in its namespaces when ``isolated``)."""

    def __init__(self, argv: list[str], run: Path, snapshot_dir: Path | None, isolated: bool, disk_mb: int,
                 log_path: Path) -> None:
        self.run, self.paths = run.resolve(), RunPaths(run.resolve())
        self.snapshot_dir, self.isolated = snapshot_dir, isolated
        cmd = [sys.executable, "-m", "stalwart", "train", *argv]
        self.paths.checkpoints.mkdir(parents=True, exist_ok=True)
        if isolated:
            cmd = ["unshare", "-m", "-n", "--propagation", "private", "sh", "-c", _WRAPPER, "chaos",
                   str(self.paths.checkpoints), str(disk_mb), *cmd]
        self.log = log_path.open("w")
        self.started = time.time()
        # A session of its own (the drill signals the whole job), stopped with the drill however it ends.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent)

    # ------------------------------------------------------------------ what the job looks like
    def running(self) -> bool:
        return self.proc.poll() is None

    def inside(self, path: Path) -> Path:
        """``path`` as the job sees it (through its mount namespace when isolated)."""
        return Path(f"/proc/{self.proc.pid}/root{path}") if self.isolated and self.running() else path

    @property
    def checkpoints(self) -> Path:
        return self.inside(self.paths.checkpoints)

    def beats(self, nproc: int) -> dict[int, dict]:
        return read_heartbeats(self.paths, list(range(nproc)))

    def training(self, nproc: int) -> dict[int, dict] | None:
        """Every rank's heartbeat when the whole group of the newest attempt trains, else None."""
        beats = self.beats(nproc)
        attempt = max((b.get("attempt", -1) for b in beats.values()), default=-1)
        live = {r: b for r, b in beats.items() if b.get("attempt") == attempt and b.get("phase") == "train"
                and pid_alive(int(b.get("pid", 0)))}
        return live if len(live) == nproc else None

    def progress(self) -> int:
        """Newest step a restart could resume from (what the supervisor counts as progress)."""
        return newest_state_step(self.inside(self.run), self.snapshot_dir)

    def events(self) -> list[dict]:
        path = self.paths.events
        out = []
        for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # the line being written
        return out

    def nsenter(self, *cmd: str) -> subprocess.CompletedProcess:
        """Run ``cmd`` in the job's network namespace."""
        return subprocess.run(["nsenter", f"--net=/proc/{self.proc.pid}/ns/net", *cmd], capture_output=True,
                              text=True)

    # ------------------------------------------------------------------ the end
    def wait(self, deadline: float) -> int | None:
        """The exit code, or None when the deadline passed first (the job is then stopped)."""
        try:
            return self.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.stop()
            return None

    def stop(self) -> None:
        """Stop the whole job: SIGCONT (a stopped worker) and SIGTERM to its session, then SIGKILL."""
        if self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
