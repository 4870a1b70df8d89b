"""Chaos from outside: SIGKILLs and SIGSTOPs of workers sent by this test (not Stalwart's injector) to
runs under the default supervision, in training and in a restart's start-up. Each run ends with exit
0 and weights bitwise equal to one uninterrupted run's (shared by the tests of this module)."""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import TINY_RUN, popen_cli, run_cli, step_losses

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


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """The uninterrupted run every drill ends bit-identical to."""
    run = tmp_path_factory.mktemp("clean") / "run"
    run_cli("train", "--run.dir", str(run), *COMMON, timeout=400)
    return run


def _same_as(clean: Path, run: Path) -> None:
    assert step_losses(run) == step_losses(clean)  # exact, every step
    a, b = clean / "checkpoints" / f"step-{STEPS}", run / "checkpoints" / f"step-{STEPS}"
    assert digest(a, "model.") == digest(b, "model.") and digest(a, "optim.") == digest(b, "optim.")


def test_random_kills_and_stops_from_outside_end_bit_identical(tmp_path, clean):
    chaos = tmp_path / "chaos"
    rng = random.Random(12)
    kinds = rng.sample([signal.SIGKILL, signal.SIGSTOP], 2)  # both kinds, in a random order
    slow = ["--fault.inject", "slow:rank=0,factor=4,steps=1-45"]  # stretch the run (sleeps only) so faults land
    proc = popen_cli("train", "--run.dir", str(chaos), *COMMON, *slow,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    _same_as(clean, chaos)


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _wait(what, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("timed out waiting for the run")


def test_faults_in_training_and_in_start_up_are_blamed_timed_and_not_a_crash_loop(tmp_path, clean):
    """Rank 0 stopped then rank 1 killed while training; rank 0 killed in the restart's start-up; rank 1
    stopped in the next start-up (no heartbeat yet). Two start-up failures in a row, no progress between,
    crash_loop_restarts = 2: they fail different ways, so this is luck, not a loop."""
    run = tmp_path / "run"
    proc = popen_cli("train", "--run.dir", str(run), *COMMON,
                             "--launch.max_restarts", "5", "--fault.crash_loop_restarts", "2",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ft = run / "ft"
        beats = _wait(lambda: (got := [_read(ft / "heartbeat" / f"rank-{r}.json") for r in (0, 1)]) and all(
            b and b["step"] >= 3 for b in got) and got)
        os.kill(beats[0]["pid"], signal.SIGSTOP)
        time.sleep(0.3)
        os.kill(beats[1]["pid"], signal.SIGKILL)
        rec = _wait(lambda: (r := _read(ft / "startup" / "rank-0.json")) and r["attempt"] == 1 and r)
        os.kill(rec["pid"], signal.SIGKILL)
        rec = _wait(lambda: (r := _read(ft / "startup" / "rank-1.json")) and r["attempt"] == 2 and r)
        os.kill(rec["pid"], signal.SIGSTOP)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    fails = [e for e in events if e["event"] == "failure"]
    assert [(f["rank"], f["kind"], f["exitcode"]) for f in fails] == [
        (1, "signal", -9), (0, "signal", -9), (1, "unresponsive", None)]
    kill_train, kill_start, stop_start = fails
    assert kill_train["phase"] == "train" and kill_train["also_stopped"] == [0]
    assert 0 < kill_train["detection_latency_s"] < 1.5 and 0 < kill_start["detection_latency_s"] < 1.5
    assert kill_start["phase"] != "train" and stop_start["phase"] != "train"  # both landed in start-up
    assert 3.0 <= stop_start["detection_latency_s"] < 6.0
    assert [f["decision"] for f in fails] == ["restart"] * 3
    restart = next(e for e in events if e["event"] == "restart")
    assert restart["time"] - kill_train["detect_time"] < 5.0  # not torch's 30 s wait for the stopped rank
    startups = [e for e in events if e["event"] == "startup"]
    assert [s["attempt"] for s in startups] == [0, 3]  # attempts 1 and 2 never reached a step
    assert {"imports_s", "group_s", "data_s", "model_s", "restore_s", "first_step_s"} <= set(startups[0]["ranks"]["0"])
    assert "nproc_per_node = 2" in (run / "config.toml").read_text()  # --config <run>/config.toml relaunches 2
    _same_as(clean, run)


def test_stalwart_chaos_sends_every_kind_from_outside_and_ends_equal_to_the_clean_run(tmp_path, clean):
    """`stalwart chaos` through the CLI, one fault of each kind (kill -9, SIGSTOP, a slowed worker, a full
    disk during a save, a partitioned worker, corrupted memory snapshots), compared with the module's
    clean run: every fault is detected where the run can see it, and the fingerprints are equal."""
    from stalwart.chaos.faults import KINDS
    from stalwart.chaos.job import namespaces_unavailable

    kinds = [k for k in KINDS if not (namespaces_unavailable() and k in ("disk_full", "partition"))]
    run = tmp_path / "chaos"
    proc = run_cli("chaos", "--faults", str(len(kinds)), "--kinds", ",".join(kinds), "--seed", "3", "--gap",
                   "0.2-0.5", "--hold", "20", "--slow", "3", "--timeout", "400", "--reference", str(clean), "--",
                   *COMMON, "--checkpoint.memory_interval", "1", "--launch.max_restarts", "6", "--run.dir", str(run),
                   check=False, timeout=450)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert f"identical: {STEPS} common steps" in proc.stdout
    rows = [json.loads(x) for x in (run / "chaos.jsonl").read_text().splitlines()]
    faults, result = rows[:-1], rows[-1]
    assert result["result"] == "equal" and result["exit"] == 0 and not result["problems"], result
    by_kind = {f["kind"]: f for f in faults}
    assert sorted(by_kind) == sorted(kinds) and all(f["sent"] for f in faults), faults
    for kind in ("kill", "stop", "corrupt_snapshot", "partition"):
        if kind in by_kind:
            f = by_kind[kind]
            assert f["detected_as"]["decision"] == "restart" and f["detection_s"] > 0 and f["recovery_s"] > 0, f
    for kind in ("kill", "stop", "corrupt_snapshot"):
        assert by_kind[kind]["detected_as"]["rank"] == by_kind[kind]["target"]["rank"], by_kind[kind]
    # A stop is found by the heartbeat timeout (3 s) and a partition by the progress timeout (6 s), each
    # counted from the rank's last beat or step, which came a moment before the fault.
    assert by_kind["kill"]["detection_s"] < 1.5 and 2.5 <= by_kind["stop"]["detection_s"] < 10.0
    corrupt = by_kind["corrupt_snapshot"]
    assert corrupt["files_corrupted"] >= 2 and corrupt["resumed"]["source"] == "disk", corrupt  # refused: checksum
    assert corrupt["resumed"]["step"] < max(corrupt["snapshot_steps"]), corrupt
    if "disk_full" in by_kind:
        full = by_kind["disk_full"]
        assert "no space left" in full["error"] and full["next_save_step"] >= full["target"]["step"], full
        assert 5.0 <= by_kind["partition"]["detection_s"] < 20.0, by_kind["partition"]
    assert by_kind["slow"]["stopped_s"] > 0
    assert not list((run / "checkpoints").glob(".chaos-*")) and (run / "checkpoints" / f"step-{STEPS}").is_dir()
