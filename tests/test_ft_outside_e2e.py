"""Faults from outside the job (kill -9, SIGSTOP), landing in training and in a restart's start-up:
the supervisor blames the rank that failed, measures detection latency, tells bad luck from a crash
loop, and the run still ends bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, TINY_RUN, cli_env, run_cli, step_losses

from stalwart.checkpoint.inspect import digest

pytestmark = pytest.mark.e2e

COMMON = [*TINY_RUN, "--training.steps", "12", "--checkpoint.interval", "6", "--checkpoint.memory_interval", "2",
          "--nproc-per-node", "2", "--fault.heartbeat_interval_s", "0.2", "--fault.heartbeat_timeout_s", "3",
          "--fault.progress_timeout_s", "5", "--fault.collective_timeout_s", "60", "--fault.init_timeout_s", "180"]


def _read(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _wait(what, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("timed out waiting for the run")


def _events(run, name):
    evs = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in evs if e["event"] == name]


def test_outside_faults_in_training_and_start_up_end_bit_for_bit(tmp_path):
    straight, faulty = tmp_path / "straight", tmp_path / "faulty"
    run_cli("train", "--run.dir", str(straight), *COMMON)
    proc = subprocess.Popen([sys.executable, "-m", "stalwart", "train", "--run.dir", str(faulty), *COMMON,
                             "--launch.max_restarts", "5", "--fault.crash_loop_restarts", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=REPO)
    try:
        ft = faulty / "ft"
        # 1. In training: rank 0 stopped, then rank 1 killed. Rank 1's death is the failure, seen at once.
        beats = _wait(lambda: (got := [_read(ft / "heartbeat" / f"rank-{r}.json") for r in (0, 1)]) and all(
            b and b["step"] >= 3 for b in got) and got)
        pids = {r: b["pid"] for r, b in enumerate(beats)}
        os.kill(pids[0], signal.SIGSTOP)
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGKILL)
        # 2. In the restart's start-up: rank 0 killed as soon as it notes a start-up phase.
        rec = _wait(lambda: (r := _read(ft / "startup" / "rank-0.json")) and r["attempt"] == 1 and r)
        os.kill(rec["pid"], signal.SIGKILL)
        # 3. In the next start-up: rank 1 stopped (no heartbeat yet: the agent sees the stopped process).
        rec = _wait(lambda: (r := _read(ft / "startup" / "rank-1.json")) and r["attempt"] == 2 and r)
        os.kill(rec["pid"], signal.SIGSTOP)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]

    fails = _events(faulty, "failure")
    assert [(f["rank"], f["kind"], f["exitcode"]) for f in fails] == [
        (1, "signal", -9), (0, "signal", -9), (1, "unresponsive", None)]
    kill_train, kill_start, stop_start = fails
    assert kill_train["phase"] == "train" and kill_train["also_stopped"] == [0]
    assert 0 < kill_train["detection_latency_s"] < 1.5 and 0 < kill_start["detection_latency_s"] < 1.5
    assert kill_start["phase"] != "train" and stop_start["phase"] != "train"  # both landed in start-up
    assert 3.0 <= stop_start["detection_latency_s"] < 6.0
    assert [f["decision"] for f in fails] == ["restart"] * 3  # two start-up failures of different ways: luck
    restarts = _events(faulty, "restart")
    assert restarts[0]["time"] - kill_train["detect_time"] < 5.0  # not torch's 30 s wait for the stopped rank
    startups = _events(faulty, "startup")
    assert [s["attempt"] for s in startups] == [0, 3]  # attempts 1 and 2 never reached a step
    assert {"imports_s", "group_s", "data_s", "model_s", "restore_s", "first_step_s"} <= set(startups[0]["ranks"]["0"])

    assert "nproc_per_node = 2" in (faulty / "config.toml").read_text()  # --config <run>/config.toml relaunches 2
    assert step_losses(straight) == step_losses(faulty)  # exact, every step
    a, b = straight / "checkpoints" / "step-12", faulty / "checkpoints" / "step-12"
    assert digest(a, "model.") == digest(b, "model.") and digest(a, "optim.") == digest(b, "optim.")
