"""One run per run directory, restarts by default, and no worker outlives its launcher: real processes,
real signals, through the real CLI."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_RUN, assert_same_states, cli_env, popen_cli, run_cli, step_losses

from stalwart.checkpoint.manager import MANIFEST

pytestmark = pytest.mark.e2e

COMMON = [*TINY_RUN, "--checkpoint.interval", "4", "--checkpoint.keep_last", "0", "--checkpoint.async_save", "false"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _events(run: Path, name: str) -> list[dict]:
    lines = (run / "events.jsonl").read_text().splitlines() if (run / "events.jsonl").is_file() else []
    return [json.loads(x) for x in lines if f'"event": "{name}"' in x and x.endswith("}")]


def _listening(pids: list[int]) -> list[str]:
    """Addresses the processes ``pids`` accept TCP connections on (from /proc, as ``ip:port``)."""
    owned = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    owned.add(link[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in owned:  # LISTEN
                ip, port = f[1].split(":")
                raw = bytes.fromhex(ip)
                addr = socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6,
                                        b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                out.append(f"{addr}:{int(port, 16)}")
    return out


def _worker_pids(run: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in (run / "ft" / "heartbeat").glob("rank-*.json")]


def test_killed_worker_restarts_second_run_refused_killed_launcher_takes_its_workers(tmp_path):
    run, clean = tmp_path / "run", tmp_path / "clean"
    steps = ["--training.steps", "2000"]  # the same schedule for every run here; reruns stop early
    slow = ["--fault.inject", "slow:rank=1,factor=10,steps=1-2000"]  # sleeps only: the losses are unchanged
    launcher = popen_cli("train", "--run.dir", str(run), *COMMON, *steps,
                                 *slow, "--nproc-per-node", "2", stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (run / "checkpoints" / "step-8").is_dir(), 240, "the first run's step 8")
        # By default a crashed worker is restarted (no --launch.max_restarts given): kill -9 one from outside.
        os.kill(_worker_pids(run)[-1], signal.SIGKILL)
        _wait_for(lambda: _events(run, "recovered"), 120, "the supervisor to restart the group and train again")
        assert [(e["kind"], e["decision"]) for e in _events(run, "failure")] == [("signal", "restart")]
        # A single-host run listens on loopback only: the launcher's rendezvous store, rank 0's store, gloo.
        listening = _listening([launcher.pid, *_worker_pids(run)])
        assert len(listening) >= 3 and all(a.startswith(("127.0.0.1:", "::1:")) for a in listening), listening
        # A second `stalwart train` and a plain torchrun on the same directory refuse at once, naming the holder.
        second = run_cli("train", "--run.dir", str(run), *COMMON, "--training.steps", "3", check=False)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().splitlines() == [
            line for line in second.stderr.splitlines() if "in use by another run (host" in line]
        assert f"PID {launcher.pid}," in second.stderr and str(run) in second.stderr
        tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                             "-m", "stalwart.train", "--run.dir", str(run), *COMMON, "--training.steps", "3"],
                            env=cli_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
        assert tr.returncode != 0 and "in use by another run (host" in tr.stderr
        assert "Traceback" not in tr.stderr.split("in use by another run")[0].split("Root Cause")[0]

        workers = _worker_pids(run)
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        launcher.send_signal(signal.SIGKILL)  # the launcher dies without a word
        launcher.wait(timeout=10)
        _wait_for(lambda: not any(_alive(p) for p in workers), 5, "the orphaned workers to stop")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate(timeout=30)

    # Every committed checkpoint is whole; the rerun takes the dead run's lock over and ends bit for bit
    # where an uninterrupted run ends.
    for ck in (run / "checkpoints").glob("step-*"):
        assert (ck / MANIFEST).is_file(), ck
    # The dead run may have logged a step past its last checkpoint (killed while saving the next one): the rerun
    # goes beyond every step it logged, so each logged loss is the rerun's.
    last = max(max(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*")), max(step_losses(run)))
    end = [*steps, "--training.stop_at_step", str(last + 3)]
    rerun = run_cli("train", "--run.dir", str(run), *COMMON, *end, "--nproc-per-node", "2")
    assert "warning: taking over the lock" in rerun.stderr and "is gone" in rerun.stderr
    run_cli("train", "--run.dir", str(clean), *COMMON, *end, "--nproc-per-node", "2")
    assert_same_states(run, clean)
    assert not (run / "run.lock").exists()
    assert not any(_alive(p) for p in _worker_pids(run) if p != os.getpid())


def test_ctrl_c_stops_every_worker_in_one_line_and_the_run_resumes(tmp_path):
    """Ctrl-C reaches the launcher and every worker (one process group): one line, exit 130, no worker
    left, and the same command resumes from the newest checkpoint."""
    run = tmp_path / "run"
    cmd = ["train", "--run.dir", str(run), *COMMON, "--training.steps", "2000", "--nproc-per-node", "2"]
    launcher = popen_cli(*cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    try:
        _wait_for(lambda: (run / "checkpoints" / "step-4").is_dir(), 240, "the first checkpoint")
        workers = _worker_pids(run)
        os.killpg(launcher.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "stopped by SIGINT; the same command resumes from" in lines[0], err
    assert not any(_alive(p) for p in workers)
    again = run_cli("train", "--run.dir", str(run), *COMMON, "--training.steps", "6", "--nproc-per-node", "2")
    assert any(e["step"] >= 4 for e in _events(run, "resumed")), again.stdout
