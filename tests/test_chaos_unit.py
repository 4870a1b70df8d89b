"""`stalwart chaos` without a job: the schedule, refusals in one line, and how the fault log reads a run's
records (the drill itself runs in tests/test_chaos_drill_e2e.py)."""

import random

import pytest

from stalwart.chaos.drill import _with_run_dir, annotate, plan
from stalwart.chaos.faults import KINDS, unavailable
from stalwart.cli import main as cli

pytestmark = pytest.mark.unit


def test_the_schedule_holds_every_kind_and_depends_only_on_the_seed():
    a, b = plan(KINDS, 20, random.Random(1)), plan(KINDS, 20, random.Random(1))
    assert a == b and len(a) == 20 and set(a) == set(KINDS)
    assert max(a.count(k) for k in KINDS) - min(a.count(k) for k in KINDS) <= 1
    assert sorted(plan(KINDS, 6, random.Random(2))) == sorted(KINDS)
    assert a != plan(KINDS, 20, random.Random(2))


def test_run_dir_is_replaced_for_the_reference():
    assert _with_run_dir(["--config", "debug", "--run.dir", "a", "--run.dir=b", "-x"], "ref") == [
        "--config", "debug", "-x", "--run.dir", "ref"]


def test_a_kind_that_cannot_run_says_why():
    assert unavailable("partition", 1, 0, 10, None).startswith("a partition needs 2")
    assert "memory_interval" in unavailable("corrupt_snapshot", 2, 0, 10, None)
    assert "checkpoint.interval" in unavailable("corrupt_snapshot", 2, 2, 0, None)
    assert "checkpoint.interval" in unavailable("disk_full", 2, 0, 0, None)
    assert unavailable("disk_full", 2, 0, 10, "needs root") == "needs root"
    assert unavailable("kill", 1, 0, 0, "needs root") is None


@pytest.mark.parametrize("args, words", [
    (["--kinds", "corrupt_snapshot"], "--kinds corrupt_snapshot: a corrupted memory snapshot needs snapshots and"),
    (["--kinds", "kil"], "unknown fault kind 'kil'"),
    (["--gap", "3"], "--gap '3': give seconds as LO-HI"),
    (["--faults", "12"], "launch.max_restarts is 3: the schedule has"),
])
def test_mistakes_are_one_line_and_exit_2(tmp_path, capsys, args, words):
    argv = ["chaos", *args, "--", "--config", "debug", "--nproc-per-node", "2", "--run.dir", str(tmp_path / "r")]
    if args[0] == "--faults":
        argv += ["--checkpoint.memory_interval", "2"]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_the_fault_log_reads_detection_and_recovery_from_the_runs_records():
    sent = [{"kind": "kill", "rank": 1, "pid": 11, "step": 5, "time": 100.0, "until": 100.0, "t": 10.0, "sent": True},
            {"kind": "disk_full", "rank": 0, "pid": 12, "step": 9, "time": 110.0, "freed": 111.0, "until": 113.1,
             "t": 20.0, "sent": True},
            {"kind": "corrupt_snapshot", "rank": 0, "pid": 12, "step": 12, "time": 120.0, "until": 120.0, "t": 30.0,
             "sent": True, "snapshot_steps": [12]}]
    events = [
        {"event": "failure", "time": 100.2, "detect_time": 100.2, "rank": 1, "kind": "signal", "phase": "train",
         "decision": "restart", "detection_latency_s": 0.1},
        {"event": "recovered", "time": 104.0, "recovery_s": 3.8, "steps_recomputed": 1},
        {"event": "checkpoint_failed", "time": 110.5, "step": 10, "error": "no space left on the device"},
        {"event": "checkpoint_saved", "time": 110.9, "step": 10},  # before the disk was freed: not the recovery
        {"event": "checkpoint_saved", "time": 113.0, "step": 12},
        {"event": "failure", "time": 120.1, "detect_time": 120.1, "rank": 0, "kind": "signal", "phase": "train",
         "decision": "restart", "detection_latency_s": 0.05},
        {"event": "resumed", "time": 122.0, "step": 10, "source": "disk"},
        {"event": "recovered", "time": 123.0, "recovery_s": 2.9, "steps_recomputed": 2},
    ]
    kill, full, corrupt = annotate(sent, events)
    assert kill["detection_s"] == pytest.approx(0.2) and kill["recovery_s"] == 3.8 and kill["target"]["rank"] == 1
    assert kill["detected_as"]["rank"] == 1 and kill["fault_to_step_s"] == pytest.approx(4.0)
    assert full["detection_s"] == pytest.approx(0.5) and full["recovery_s"] == pytest.approx(2.0)
    assert full["next_save_step"] == 12 and "detected_as" not in full
    assert corrupt["resumed"] == {"source": "disk", "step": 10} and "refused by its checksum" in corrupt["outcome"]
    events[6] = {"event": "resumed", "time": 122.0, "step": 12, "source": "memory"}  # the corrupted one: a failure
    assert annotate(sent, events)[2]["outcome"] == "restored the corrupted snapshot of step 12"
