"""Saving on preemption, through the real CLI: SIGTERM makes every rank finish its step, checkpoint it
and exit 75; the rerun resumes from exactly that step. A second SIGTERM exits at once."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_RUN, cli_env, popen_cli, read_metrics, run_cli

from stalwart.checkpoint.manager import MANIFEST


def _events(run: Path, name: str) -> list[dict]:
    path = run / "events.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [e for e in (json.loads(x) for x in lines if x.strip()) if e["event"] == name]


def _logged_steps(run: Path) -> int:
    return len([m for m in read_metrics(run) if "loss" in m]) if (run / "metrics.jsonl").is_file() else 0


@pytest.mark.e2e
def test_sigterm_saves_the_step_exits_75_and_the_rerun_resumes_there(tmp_path):
    run = tmp_path / "run"
    # No periodic checkpoint: whatever is saved is the preemption's. Slurm's scancel and a terminal signal
    # every process of the job: the workers get SIGTERM directly and again from the launcher.
    args = [*TINY_RUN, "--training.steps", "2000", "--checkpoint.interval", "0", "--nproc-per-node", "2",
            "--sample.max_new_tokens", "0"]
    launcher = popen_cli("train", "--run.dir", str(run), *args,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while _logged_steps(run) < 3 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
        assert _logged_steps(run) >= 3, "the run never trained"
        os.killpg(launcher.pid, signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 75, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "SIGTERM: saved checkpoint step" in lines[0] and "exit 75" in lines[0], err[-3000:]
    (saved,) = _events(run, "preempted")
    last = max(m["step"] for m in read_metrics(run) if "loss" in m)
    assert saved["step"] == last and saved["signal_to_durable_s"] > 0  # no trained step is lost
    ckpt = run / "checkpoints" / f"step-{last}"
    assert (ckpt / MANIFEST).is_file() and [p.name for p in (run / "checkpoints").glob("step-*")] == [ckpt.name]
    # The fingerprint's per-tensor sums (each FSDP rank summed its shard) are the whole tensors' sums.
    from stalwart.checkpoint.inspect import load_flat
    from stalwart.train.fingerprint import read_tensor_sums
    from stalwart.train.word_sums import MASK, int_sum

    flat, sums = load_flat(ckpt), read_tensor_sums(run / "fingerprints.jsonl")[last]
    whole = {k: flat["model." + k[7:]] if k.startswith("params/") else
             flat["optim.state.{}.{}".format(*k.split("/")[1:])] for k in sums}
    assert sums and all(int(int_sum(whole[k])) & MASK == v for k, v in sums.items())
    before = (run / "config.toml").read_text()
    out = run_cli("train", "--run.dir", str(run), *args, "--training.stop_at_step", str(last + 2)).stdout
    assert [e["step"] for e in _events(run, "resumed")] == [last]
    # The resume changed a setting: one line names it, an event records it, the previous config is kept.
    noted = [x for x in out.splitlines() if "config changed" in x]
    assert len(noted) == 1 and f"training.stop_at_step 0 -> {last + 2} (previous config kept as " in noted[0], out
    (changed,) = _events(run, "config_changed")
    assert changed["changes"] == {"training.stop_at_step": [0, last + 2]}
    assert (run / "config.toml.prev").read_text() == before and changed["previous"] == str(run / "config.toml.prev")
    # A healthy run, its SIGTERM's flight-recorder dumps left behind: nothing wrong, exit 0.
    diag = run_cli("diagnose", str(run)).stdout
    assert "no divergence" in diag and diag.rstrip().endswith("verdict: nothing wrong now (exit 0)"), diag


_SECOND_SIGNAL = textwrap.dedent("""
    import os, signal, sys, time
    from stalwart.train.preempt import PreemptionSignal
    with PreemptionSignal() as p:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)   # the same request, delivered twice: still running
        assert p.requested_at is not None and p.agreed()
        print("flagged", flush=True)
        time.sleep(1.2)
        os.kill(os.getpid(), signal.SIGTERM)   # a second request: out at once
        time.sleep(5)
    print("not reached")
""")


@pytest.mark.unit
def test_a_second_sigterm_exits_at_once_and_a_duplicate_does_not():
    proc = subprocess.run([sys.executable, "-c", _SECOND_SIGNAL], env=cli_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 143 and proc.stdout.split() == ["flagged"], (proc.stdout, proc.stderr)
    assert "second SIGTERM: exiting now" in proc.stderr
