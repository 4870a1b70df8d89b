"""The job under chaos: one ``stalwart train`` command, seen and touched only from outside.

With root (``unshare -m -n`` works) the command runs in a private mount and network namespace of its
own: the run's ``checkpoints`` directory (each replica group's, with ``fault.group_recovery``) is a
small tmpfs there (a disk that can be filled) and the ranks talk over a loopback of their own (one
rank's connections can be cut with ``tc`` without touching any other process on the machine). The
namespaces die with the job; the checkpoints are copied back onto the real directory when the command
ends. Without root the command runs as is and the kinds that need the namespaces are skipped.

Everything the drill knows about the job it reads from files the job writes anyway, in each replica
group's directory (``chaos/groups.py``; a job without groups is one, the run directory): heartbeats
(``ft/heartbeat``: each rank's pid, attempt, phase and step), ``events.jsonl``, ``metrics.jsonl``,
the checkpoint and snapshot directories.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from stalwart.chaos.groups import Layout, StepTimes, read_events, read_step_times
from stalwart.ft.records import read_heartbeats
from stalwart.ft.supervisor import newest_state_step
from stalwart.paths import RunPaths
from stalwart.procs import die_with_parent, pid_alive

# Runs inside the namespaces: a tmpfs on each checkpoint directory given before "--" (every replica
# group's), loopback up, the command; then the checkpoints go back to disk.
_WRAPPER = """
set -u
mb="$1"; shift
dirs=""
while [ "$1" != "--" ]; do
  mount -t tmpfs -o "size=${mb}m" stalwart-chaos "$1" || exit 90
  dirs="$dirs$1
"
  shift
done
shift
ip link set lo up || exit 91
"$@" &
child=$!
trap 'kill -TERM $child 2>/dev/null' TERM INT
wait $child; rc=$?
while kill -0 $child 2>/dev/null; do wait $child; rc=$?; done
printf '%s' "$dirs" | while IFS= read -r ck; do
  keep="$ck.chaos-keep"
  rm -rf "$keep"; mkdir "$keep"; rm -f "$ck"/.chaos-filler*; cp -a "$ck"/. "$keep"/
  umount "$ck" && cp -a "$keep"/. "$ck"/ && rm -rf "$keep"
done
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
    """``stalwart train ARGV`` started in the background (in its namespaces when ``isolated``), laid out as
    ``layout`` says (one group, or replica groups each in its own directory)."""

    def __init__(self, argv: list[str], run: Path, layout: Layout, memory_dir: str | None, isolated: bool,
                 disk_mb: int, log_path: Path) -> None:
        self.run, self.paths, self.layout = run.resolve(), RunPaths(run.resolve()), layout
        self.groups = layout.dirs(self.run)
        self.snapshot_dirs = [p.snapshots(memory_dir) if memory_dir is not None else None for p in self.groups]
        self.isolated = isolated
        cmd = [sys.executable, "-m", "stalwart", "train", *argv]
        for p in self.groups:
            p.checkpoints.mkdir(parents=True, exist_ok=True)
        if isolated:
            cmd = ["unshare", "-m", "-n", "--propagation", "private", "sh", "-c", _WRAPPER, "chaos", str(disk_mb),
                   *(str(p.checkpoints) for p in self.groups), "--", *cmd]
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

    def checkpoints(self, group: int = 0) -> Path:
        return self.inside(self.groups[group].checkpoints)

    def beats(self) -> dict[int, dict]:
        """Every rank's newest heartbeat, by its rank in the job (``group`` added: its replica group)."""
        out = {}
        for g, paths in enumerate(self.groups):
            for r, beat in read_heartbeats(paths, list(range(self.layout.size))).items():
                out[g * self.layout.size + r] = {**beat, "group": g}
        return out

    def training(self) -> dict[int, dict] | None:
        """Every rank's heartbeat when every group trains in its newest attempt, else None."""
        beats = self.beats()
        for g in range(self.layout.groups):
            mine = [beats.get(r) for r in self.layout.ranks(g)]
            if any(b is None for b in mine):
                return None
            attempt = max(b.get("attempt", -1) for b in mine)
            if not all(b.get("attempt") == attempt and b.get("phase") == "train" and pid_alive(int(b.get("pid", 0)))
                       for b in mine):
                return None
        return beats

    def progress(self, group: int = 0) -> int:
        """Newest step a restart of ``group`` could resume from (what its supervisor counts as progress)."""
        return newest_state_step(self.inside(self.groups[group].root), self.snapshot_dirs[group])

    def events(self, group: int = 0) -> list[dict]:
        """Group ``group``'s events (group 0's file is the run's: the launcher's events are there too)."""
        return read_events(self.groups[group].events)

    def all_events(self) -> dict[int, list[dict]]:
        return {g: self.events(g) for g in range(self.layout.groups)}

    def step_times(self) -> StepTimes:
        return {g: read_step_times(p.metrics) for g, p in enumerate(self.groups)}

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
