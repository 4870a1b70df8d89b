"""A chaos drill from outside: random SIGKILLs and SIGSTOPs of workers, bounded in count and time,
sent by this test (not Stalwart's injector) to a run under the default supervision. The run ends
with exit 0 and weights bitwise equal to an uninterrupted run's."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY_RUN, cli_env, run_cli, step_losses

from stalwart.checkpoint.inspect import digest

pytestmark = pytest.mark.e2e

STEPS = 45
COMMON = [*TINY_RUN, "--nproc-per-node", "2", "--training.steps", str(STEPS), "--checkpoint.interval", "3",
          "--checkpoint.keep_last", "0", "--sample.max_new_tokens", "0", "--fault.heartbeat_interval_s", "0.2",
          "--fault.heartbeat_timeout_s", "3", "--fault.progress_timeout_s", "6", "--fault.collective_timeout_s", "60",
          "--fault.init_timeout_s", "180"]
FAULTS, DEADLINE_S = 2, 300


def _beats(run: Path) -> dict[int, dict]:
    out = {}
    for p in (run / "ft" / "heartbeat").glob("rank-*.json"):
        try:
            rec = json.loads(p.read_text())
        except ValueError:
            continue
        out[rec["rank"]] = rec
    return out


def _newest_checkpoint(run: Path) -> int:
    return max([int(p.name[5:]) for p in (run / "checkpoints").glob("step-*") if (p / "manifest.json").exists()]
               or [0])


def test_random_kills_and_stops_from_outside_end_bit_identical(tmp_path):
    clean, chaos = tmp_path / "clean", tmp_path / "chaos"
    run_cli("train", "--run.dir", str(clean), *COMMON, timeout=400)
    rng = random.Random(12)
    kinds = rng.sample([signal.SIGKILL, signal.SIGSTOP], 2)  # both kinds, in a random order
    slow = ["--fault.inject", "slow:rank=0,factor=4,steps=1-45"]  # stretch the run (sleeps only) so faults land
    proc = subprocess.Popen([sys.executable, "-m", "stalwart", "train", "--run.dir", str(chaos), *COMMON, *slow],
                            env=cli_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sent, last_ckpt, t0 = [], 0, time.monotonic()
    try:
        while proc.poll() is None and len(sent) < FAULTS and time.monotonic() - t0 < DEADLINE_S:
            time.sleep(rng.uniform(1.0, 3.0))
            beats = _beats(chaos)
            attempt = max((b["attempt"] for b in beats.values()), default=-1)
            live = [b for b in beats.values() if b["attempt"] == attempt and b["phase"] == "train"]
            # Fault only a group that trains and has saved since the previous fault (progress, so no
            # crash loop), and not in the last steps (the run must still be going when the signal lands).
            if len(live) < 2 or _newest_checkpoint(chaos) <= last_ckpt or min(b["step"] for b in live) > STEPS - 8:
                continue
            victim = rng.choice(live)
            sig = kinds[len(sent)]
            try:
                os.kill(victim["pid"], sig)
            except ProcessLookupError:
                continue
            sent.append((sig.name, victim["rank"], victim["step"]))
            last_ckpt = _newest_checkpoint(chaos)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, (sent, err[-3000:])
    assert len(sent) == FAULTS, sent  # the drill really happened
    events = [json.loads(x) for x in (chaos / "events.jsonl").read_text().splitlines() if x.strip()]
    failures = [e for e in events if e["event"] == "failure"]
    assert len(failures) == len(sent) and all(f["decision"] == "restart" for f in failures), (sent, failures)
    assert [f["rank"] for f in failures] == [r for _, r, _ in sent], (sent, failures)  # blamed on the victim
    assert step_losses(chaos) == step_losses(clean)
    a, b = clean / "checkpoints" / f"step-{STEPS}", chaos / "checkpoints" / f"step-{STEPS}"
    assert digest(a, "model.") == digest(b, "model.") and digest(a, "optim.") == digest(b, "optim.")
