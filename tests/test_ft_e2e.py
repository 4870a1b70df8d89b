"""Fault tolerance end to end: real processes, real signals, through the real CLI and supervisor."""

import json

import pytest
from conftest import TINY_RUN, assert_same_states, read_metrics, run_cli, step_losses

from stalwart.checkpoint.inspect import digest
from stalwart.ft.detect import EXIT_CRASH_LOOP, EXIT_RESTART_BUDGET

pytestmark = pytest.mark.e2e

# Tight but sane bounds for a loaded 2-core machine (steps take ~0.1-0.5 s here).
FAST_FT = ["--fault.heartbeat_interval_s", "0.2", "--fault.heartbeat_timeout_s", "3", "--fault.progress_timeout_s",
           "5", "--fault.collective_timeout_s", "60", "--fault.init_timeout_s", "180"]


def train(run_dir, *extra, nproc=2, check=True):
    return run_cli("train", "--run.dir", str(run_dir), *TINY_RUN, *FAST_FT, "--nproc-per-node", str(nproc), *extra,
                   check=check, timeout=400)


def events(run_dir, name=None):
    evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in evs if name is None or e["event"] == name]


def test_faults_recover_bit_identically(tmp_path):
    """THE PROOF: kill, hang and exception faults; the run ends bit-identical to an uninterrupted one."""
    common = ["--training.steps", "12", "--checkpoint.interval", "2", "--checkpoint.keep_last", "0"]
    straight, faulty = tmp_path / "straight", tmp_path / "faulty"
    train(straight, *common)
    proc = train(faulty, *common, "--launch.max_restarts", "4",
                 "--fault.inject", "kill:rank=1,step=4;hang:rank=0,step=7;exception:rank=1,step=10")
    assert "goodput" in proc.stdout and "ETTR" in proc.stdout

    assert_same_states(straight, faulty)  # exact: every step's loss and state fingerprint
    a, b = straight / "checkpoints" / "step-12", faulty / "checkpoints" / "step-12"
    assert digest(a, "model.") == digest(b, "model.")
    assert digest(a, "optim.") == digest(b, "optim.")

    # Each detector fired on its fault, within its bound; none fired on the healthy run.
    fails = events(faulty, "failure")
    assert [(f["injected"], f["kind"], f["rank"]) for f in fails] == [
        ("kill", "signal", 1), ("hang", "hang", 0), ("exception", "crash", 1)]
    kill, hang, exc = (f["detection_latency_s"] for f in fails)
    assert kill < 2.0 and exc < 3.0
    assert 5.0 - 0.5 <= hang <= 5.0 + 2.5  # progress timeout + heartbeat/monitor granularity
    rec = events(faulty, "recovered")
    assert len(rec) == 3 and all(r["steps_recomputed"] >= 0 and r["fault_to_step_s"] > 0 for r in rec)
    assert len(list((faulty / "ft" / "fired").glob("*.json"))) == 3  # each fault fired exactly once
    assert events(faulty, "supervisor_exit")[-1]["code"] == 0
    for name in ("failure", "straggler", "rollback", "step_skipped"):
        assert not events(straight, name), name
    assert not events(faulty, "config_changed")  # a restart runs the same config: nothing to note
    g = json.loads((faulty / "goodput.json").read_text())
    assert 0 < g["ettr"] < 1 and abs(sum(g["buckets"].values()) - g["wall_s"]) < 1e-6
    assert g["buckets"]["detection"] >= hang and g["buckets"]["restart"] > 0 and len(g["failures"]) == 3
    out = run_cli("goodput", str(faulty)).stdout
    assert "ETTR" in out and "productive" in out and "(injected hang)" in out

    # The summary covers the whole run, all four attempts: wall time from the first start to the finish,
    # and the eval curve from the first evaluation ever (step 0, in the first attempt) to the last.
    s, ref = (json.loads((r / "summary.json").read_text()) for r in (faulty, straight))
    first_start, finish = events(faulty, "start")[0]["time"], events(faulty, "finished")[-1]["time"]
    assert s["attempts"] == 4 and ref["attempts"] == 1
    assert abs(s["elapsed_s"] - (finish - first_start)) < 1.0 and s["elapsed_s"] > s["session_elapsed_s"] + 5
    assert s["first_eval_loss"] == ref["first_eval_loss"] == events(faulty, "eval")[0]["eval_loss"]
    assert s["first_eval_loss"] != s["final_eval_loss"] == ref["final_eval_loss"]
    wall = next(x for x in proc.stdout.splitlines() if "wall time" in x)
    assert f"{s['elapsed_s']:.1f} s over 4 attempts" in wall, wall
    assert f"eval loss       {ref['first_eval_loss']:.4f} -> " in proc.stdout


def test_a_kill_from_outside_is_one_line_and_not_counted_as_a_crash_loop(tmp_path):
    """kill -9 of a worker from outside: the supervisor says so on the console (rank, signal, where it
    landed, what it does), records it as a fault from outside, and the run finishes."""
    import os
    import signal
    import subprocess
    import time

    from conftest import popen_cli

    run = tmp_path / "run"
    proc = popen_cli("train", "--run.dir", str(run), *TINY_RUN, *FAST_FT, "--nproc-per-node", "1",
                     "--training.steps", "30", "--checkpoint.interval", "5", "--launch.max_restarts", "2",
                     "--fault.crash_loop_restarts", "1", "--fault.inject", "slow:rank=0,factor=4,steps=1-30",
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        beat, deadline = run / "ft" / "heartbeat" / "rank-0.json", time.monotonic() + 240
        while time.monotonic() < deadline:
            rec = json.loads(beat.read_text()) if beat.is_file() else {}
            if rec.get("step", 0) >= 3:
                break
            time.sleep(0.05)
        os.kill(rec["pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    (fail,) = events(run, "failure")
    assert (fail["kind"], fail["exitcode"], fail["phase"], fail["from_outside"], fail["decision"]) == (
        "signal", -9, "train", True, "restart")
    said = [x for x in err.splitlines() if x.startswith("stalwart supervisor:")]
    assert said == [f"stalwart supervisor: rank 0 was killed by SIGKILL from outside (not counted toward "
                    f"fault.crash_loop_restarts) while training (after step {fail['step']}); restarting the group"], err


def test_nan_skip_leaves_state_unchanged_and_straggler_is_named(tmp_path):
    run = tmp_path / "run"
    train(run, "--training.steps", "10", "--checkpoint.interval", "1", "--checkpoint.keep_last", "0",
          "--checkpoint.async_save", "false", "--fault.straggler_window", "4",
          "--fault.inject", "nan:rank=1,step=3;slow:rank=1,factor=3,steps=1-10")
    ck = run / "checkpoints"
    # Step 3 was not applied on any rank: weights and optimizer state (AdamW step counters too) equal step 2's.
    assert digest(ck / "step-2", "model.") == digest(ck / "step-3", "model.")
    assert digest(ck / "step-2", "optim.") == digest(ck / "step-3", "optim.")
    assert digest(ck / "step-3", "model.") != digest(ck / "step-4", "model.")  # and training goes on
    bad = [e for e in events(run, "failure") if e["kind"] == "nonfinite"]
    assert bad and bad[0]["step"] == 3 and bad[0]["ranks"] == [1] and bad[0]["policy"] == "skip"
    m = {x["step"]: x for x in read_metrics(run) if "loss" in x}
    assert m[3].get("skipped") and not m[4].get("skipped")
    st = events(run, "straggler")
    assert [(s["rank"], s["phase"]) for s in st] == [(1, "forward_backward")] and st[0]["ratio"] > 2.0
    summary = json.loads((run / "summary.json").read_text())["fault_tolerance"]
    assert summary["skipped_steps"] == [3] and summary["stragglers"][0]["rank"] == 1


def test_crash_loop_exits_do_not_requeue(tmp_path):
    proc = train(tmp_path / "run", "--training.steps", "4", "--launch.max_restarts", "5",
                 "--fault.crash_loop_restarts", "2", "--fault.inject", "exception:step=2,once=0", nproc=1,
                 check=False)
    assert proc.returncode == EXIT_CRASH_LOOP, proc.stderr[-2000:]
    assert "crash loop" in proc.stderr
    assert [f["decision"] for f in events(tmp_path / "run", "failure")] == ["restart", "crash_loop"]


def test_restart_budget_exit_code(tmp_path):
    proc = train(tmp_path / "run", "--training.steps", "6", "--launch.max_restarts", "1",
                 "--checkpoint.interval", "1", "--checkpoint.async_save", "false",
                 "--fault.inject", "exception:step=2;exception:step=4", nproc=1, check=False)
    assert proc.returncode == EXIT_RESTART_BUDGET, proc.stderr[-2000:]
    assert "restart budget" in proc.stderr
    assert [f["decision"] for f in events(tmp_path / "run", "failure")] == ["restart", "budget_exhausted"]


def test_rollback_skips_the_bad_step_deterministically(tmp_path):
    """nonfinite = rollback: restart from the last good state and skip the step; ends where `skip` ends."""
    common = ["--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.async_save", "false",
              "--checkpoint.keep_last", "0", "--fault.inject", "nan:step=5"]
    skip, rolled = tmp_path / "skip", tmp_path / "rolled"
    train(skip, *common, nproc=1)
    train(rolled, *common, "--fault.nonfinite", "rollback", "--launch.max_restarts", "2", nproc=1)
    assert events(rolled, "rollback")[0]["steps"] == [5]
    fail = [f for f in events(rolled, "failure") if "detect_time" in f]
    assert [(f["kind"], f["decision"]) for f in fail] == [("rollback", "restart")]
    assert any(e["event"] == "resumed" and e["step"] == 4 for e in events(rolled))
    assert [e["step"] for e in events(rolled, "step_skipped")] == [5]
    a, b = skip / "checkpoints" / "step-6", rolled / "checkpoints" / "step-6"
    assert digest(a, "model.") == digest(b, "model.") and digest(a, "optim.") == digest(b, "optim.")
    assert_same_states(skip, rolled, skip=(5,))


def test_failing_host_is_excluded_and_the_job_shrinks(tmp_path):
    """A "host" (here: one local process, fault.host_size 1) that fails twice is excluded; the job goes on at
    data-parallel degree 1 with the same global batch (twice the gradient accumulation)."""
    run = tmp_path / "run"
    train(run, "--training.steps", "8", "--checkpoint.interval", "2", "--checkpoint.async_save", "false",
          "--launch.max_restarts", "4", "--fault.exclude_after", "2", "--fault.host_size", "1",
          "--fault.inject", "kill:rank=1,step=3;exception:rank=1,step=5")
    ex = json.loads((run / "ft" / "excluded.json").read_text())["excluded"]
    assert [(e["host"], e["ranks"]) for e in ex] == [(1, [1])]
    assert [f["decision"] for f in events(run, "failure") if "detect_time" in f] == ["restart", "exclude"]
    assert events(run, "excluded")[0]["nproc_per_node"] == 1
    assert events(run, "start")[-1]["world_size"] == 1
    assert any(e["event"] == "resumed" and e["step"] == 4 for e in events(run))  # resharded 2 -> 1 ranks
    assert sorted(step_losses(run)) == list(range(1, 9))
    assert json.loads((run / "summary.json").read_text())["steps"] == 8


def test_excluded_host_is_replaced_by_a_spare(tmp_path):
    """With a spare in reserve the excluded host is replaced: same world size, and so the run ends
    bit-identical to an uninterrupted one."""
    common = ["--training.steps", "8", "--checkpoint.interval", "2", "--checkpoint.async_save", "false"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(straight, *common)
    train(run, *common, "--launch.max_restarts", "4", "--fault.exclude_after", "2", "--fault.host_size", "1",
          "--fault.spare_hosts", "1", "--fault.inject", "kill:rank=1,step=3;exception:rank=1,step=5")
    adopted = events(run, "spare_adopted")
    assert len(adopted) == 1 and adopted[0]["host"] == 1 and adopted[0]["spares_left"] == 0
    assert not events(run, "excluded")
    assert events(run, "start")[-1]["world_size"] == 2
    assert_same_states(run, straight)
    a, b = straight / "checkpoints" / "step-8", run / "checkpoints" / "step-8"
    assert digest(a, "model.") == digest(b, "model.") and digest(a, "optim.") == digest(b, "optim.")
