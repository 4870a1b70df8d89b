"""A full disk, for real: a small tmpfs in a private mount namespace, and /dev/full under one rank's
timings file. Storage failures say what happened and where; the job ends with one line, exit 2."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, TINY_RUN, cli_env, run_cli

pytestmark = pytest.mark.e2e

TWO = [*TINY_RUN, "--nproc-per-node", "2", "--checkpoint.interval", "2", "--checkpoint.keep_last", "0",
       "--sample.max_new_tokens", "0"]


def _own_lines(stderr: str) -> list[str]:
    return [x for x in stderr.strip().splitlines() if x.strip() and not x.startswith("warning: checkpoint")]


def _can_mount_tmpfs(tmp_path) -> bool:
    if not shutil.which("unshare") or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            f"mount -t tmpfs -o size=1m tmpfs {tmp_path}"], capture_output=True)
    return probe.returncode == 0


def test_full_tmpfs_fails_the_final_save_loudly(tmp_path):
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs root and unshare to mount a private tmpfs")
    run = tmp_path / "run"
    cmd = " ".join([sys.executable, "-m", "stalwart", "train", "--run.dir", str(run), *TWO, "--training.steps", "16"])
    # The tmpfs lives only in the private mount namespace: inspect it from there before it goes.
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           f"mount -t tmpfs -o size=5m tmpfs {tmp_path} && {cmd}; rc=$?; "
                           f"cat {run}/events.jsonl >&2; ls {run}/checkpoints >&2; exit $rc"],
                          env=cli_env(), cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    events = [json.loads(x) for x in lines if x.startswith('{"time"')]
    failed = [e for e in events if e["event"] == "final_save_failed"]
    assert failed and failed[0]["step"] == 16 and failed[0]["durable_step"] is not None
    assert not any(e["event"] == "finished" for e in events)
    final = [x for x in lines if x.startswith("stalwart train: error")]
    assert len(final) == 1 and f"the newest durable checkpoint is step {failed[0]['durable_step']}" in final[0]
    warnings = [x for x in lines if x.startswith("warning: checkpoint")]
    assert warnings and all("no space left on the device writing " in x for x in warnings), warnings
    assert "Traceback" not in proc.stderr and "enforce fail" not in proc.stderr


def test_full_device_under_one_ranks_timings_ends_the_job_with_one_line(tmp_path):
    run = tmp_path / "run"
    (run / "timings").mkdir(parents=True)
    (run / "timings" / "rank-1.jsonl").symlink_to("/dev/full")  # every write there: ENOSPC
    proc = run_cli("train", "--run.dir", str(run), *TWO, "--training.steps", "30", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = _own_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        f"stalwart train: error (rank 1): no space left on the device writing {run / 'timings' / 'rank-1.jsonl'}"), \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout and "GLHF" not in proc.stderr
