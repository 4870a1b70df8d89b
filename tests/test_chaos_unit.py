"""`stalwart chaos` without a job: the schedule, refusals in one line, and how the fault log reads a run's
records (the drill itself runs in tests/test_chaos_drill_e2e.py)."""

import json
import random

import pytest

from stalwart.chaos.drill import _with_run_dir, plan
from stalwart.chaos.faultlog import annotate
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
    kill, full, corrupt = annotate(sent, {0: events})
    assert kill["detection_s"] == pytest.approx(0.2) and kill["recovery_s"] == 3.8 and kill["target"]["rank"] == 1
    assert kill["detected_as"]["rank"] == 1 and kill["fault_to_step_s"] == pytest.approx(4.0)
    assert full["detection_s"] == pytest.approx(0.5) and full["recovery_s"] == pytest.approx(2.0)
    assert full["next_save_step"] == 12 and "detected_as" not in full
    assert corrupt["resumed"] == {"source": "disk", "step": 10} and "refused by its checksum" in corrupt["outcome"]
    events[6] = {"event": "resumed", "time": 122.0, "step": 12, "source": "memory"}  # the corrupted one: a failure
    assert annotate(sent, {0: events})[2]["outcome"] == "restored the corrupted snapshot of step 12"


# ---------------------------------------------------------------------- a job of replica groups
GROUPED = ["--parallelism.dp_replicate", "2", "--training.elastic_exact", "true", "--fault.group_recovery", "true"]


def test_faults_are_aimed_across_the_groups_ranks():
    from stalwart.chaos.groups import Layout

    two_by_two, plain = Layout(2, 2, True), Layout(1, 4)
    assert [two_by_two.where(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert two_by_two.hit("kill", 3) == [3] and two_by_two.groups_hit("stop", 2) == [1]
    assert two_by_two.hit("group_kill", 3) == [2, 3] and two_by_two.groups_hit("group_kill", 1) == [0]
    assert two_by_two.hit("all_groups", 3) == [1, 3] and two_by_two.groups_hit("all_groups", 0) == [0, 1]
    # a corrupted snapshot is read only by a whole start: one rank of every group is killed
    assert two_by_two.hit("corrupt_snapshot", 2) == [0, 2] and plain.hit("corrupt_snapshot", 2) == [2]
    assert Layout(4, 1, True).hit("all_groups", 2) == [0, 1, 2, 3]
    assert [p.root.as_posix() for p in two_by_two.dirs("run")] == ["run", "run/groups/1"]


@pytest.mark.parametrize("args, words", [
    (["--nproc-per-node", "3", *GROUPED], "--nproc-per-node 3 does not split into 2 replica groups"),
    (["--nproc-per-node", "2", *GROUPED, "--fault.replica_group", "1", "--fault.lighthouse", "127.0.0.1:9"],
     "runs every replica group on this host: drop --fault.replica_group"),
    (["--nproc-per-node", "2", "--kinds", "group_kill"], "group_kill needs a job of replica groups"),
    (["--nproc-per-node", "2", *GROUPED, "--checkpoint.memory_interval", "2"],
     "faults that restart a replica group; set --launch.max_restarts"),
])
def test_group_mistakes_are_one_line_and_exit_2(tmp_path, capsys, args, words):
    kinds = args[args.index("--kinds"):args.index("--kinds") + 2] if "--kinds" in args else []
    train = [a for a in args if a not in kinds]
    assert cli(["chaos", "--faults", "8", *kinds, "--", "--config", "debug", *train, "--run.dir",
                str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "r").exists()


def _group_events():
    """Two groups' records around a kill of group 1 at t=100 and a fault of every group at t=110."""
    return {
        0: [{"event": "group_lost", "time": 100.15, "group": 1, "lighthouse_s": 0.01},
            {"event": "group_step_redone", "time": 100.3, "step": 41, "lost": [1], "wait_s": 0.05},
            {"event": "group_rejoined", "time": 101.0, "group": 1, "away_s": 0.85},
            {"event": "failure", "time": 110.1, "detect_time": 110.1, "rank": 0, "kind": "signal"},
            {"event": "group_whole_job_fallback", "time": 110.12, "group": 0},
            {"event": "restart", "time": 110.3},
            {"event": "recovered", "time": 112.0, "recovery_s": 1.9}],
        1: [{"event": "failure", "time": 100.1, "detect_time": 100.1, "rank": 0, "kind": "signal", "phase": "train",
             "decision": "restart", "detection_latency_s": 0.1},
            {"event": "restart", "time": 100.4},
            {"event": "recovered", "time": 101.2, "recovery_s": 1.1},
            {"event": "failure", "time": 110.2, "detect_time": 110.2, "rank": 0, "kind": "signal"},
            {"event": "restart", "time": 110.5},
            {"event": "recovered", "time": 112.1, "recovery_s": 1.9}],
    }


def test_the_fault_log_counts_restarts_of_the_groups_a_fault_did_not_hit():
    sent = [{"kind": "kill", "rank": 0, "pid": 11, "step": 40, "time": 100.0, "until": 100.0, "t": 5.0, "sent": True,
             "group": 1, "groups": [1]},
            {"kind": "all_groups", "rank": 0, "pid": 12, "step": 60, "time": 110.0, "until": 110.0, "t": 15.0,
             "sent": True, "group": 0, "groups": [0, 1], "pids": [12, 13]}]
    # group 0 logged step 41 twice: its redo (after the event at 100.3), and again after the whole start
    times = {0: [(40, 100.2, 0.1), (41, 100.65, 0.35), (42, 100.75, 0.1), (41, 112.5, 0.12)], 1: [(40, 100.2, 0.1)]}
    kill, everyone = annotate(sent, _group_events(), times)
    assert kill["group"] == 1 and kill["detected_as"]["group"] == 1 and kill["detection_s"] == pytest.approx(0.1)
    assert kill["restarts"] == 1 and kill["survivor_restarts"] == 0 and kill["recovery_s"] == 1.1
    assert kill["survivor_stall"] == [{"group": 0, "step": 41, "lost": [1], "wait_s": 0.05, "step_time_s": 0.35,
                                       "median_step_s": 0.11}]
    assert kill["lighthouse"] == [{"event": "lost", "group": 1, "lighthouse_s": 0.01},
                                  {"event": "rejoined", "group": 1, "away_s": 0.85}]
    assert everyone["restarts"] == 2 and everyone["survivor_restarts"] == 0 and everyone["survivor_stall"] == []
    assert {"event": "whole_job_fallback"} in everyone["lighthouse"]
    # The same kill, had it also restarted group 0 (as a stall in the exchange does): counted, and named.
    events = _group_events()
    events[0].insert(3, {"event": "restart", "time": 100.5})
    again = annotate(sent, events, times)[0]
    assert again["survivor_restarts"] == 1 and again["survivors_restarted"] == [0]
    # A fault whose only failure is another group's: the detection is that group's.
    events[1] = [e for e in events[1] if e["time"] > 105]
    events[0].insert(0, {"event": "failure", "time": 106.0, "detect_time": 106.0, "rank": 0, "kind": "hang"})
    assert annotate(sent, events, times)[0]["detected_as"]["group"] == 0


def _metrics(run, steps, *, params=lambda s: f"p{s}", data=lambda s: f"d{s}"):
    run.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "loss": 1.0 / s, "fingerprint": f"f{params(s)}{data(s)}",
                         "fingerprint_parts": {"params": params(s), "optim": f"o{s}", "data": data(s)}})
             for s in steps]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_every_groups_steps_are_compared_with_the_reference(tmp_path):
    from stalwart.chaos.groups import Layout, compare

    layout, ref, run = Layout(2, 1, True), tmp_path / "ref", tmp_path / "run"
    for g in (0, 1):
        _metrics(ref if g == 0 else ref / "groups" / str(g), range(1, 11))
    _metrics(run, range(1, 11))
    _metrics(run / "groups" / "1", [*range(1, 4), *range(7, 11)])  # away for steps 4-6
    same, line = compare(ref, run, layout, 10)
    assert same and line.startswith("identical: every group's logged steps (10 steps, 1-10, in 2 groups)"), line
    _metrics(run / "groups" / "1", range(1, 10))  # left out before the last step
    assert compare(ref, run, layout, 10) == (False, "group 1 did not log the last step (9 of 10)")
    _metrics(run / "groups" / "1", range(1, 11), params=lambda s: "x" if s == 8 else f"p{s}")
    assert compare(ref, run, layout, 10) == (False, "group 1 differs first at step 8 (params)")
    # Only the data position differs (a reference without groups counts it over other ranks): still equal.
    _metrics(run / "groups" / "1", range(1, 11), data=lambda s: "other")
    same, line = compare(ref, run, layout, 10)
    assert same and "weights, optimizer state and loss (the whole fingerprint differs)" in line, line


def test_a_reference_trained_with_another_configuration_is_named(tmp_path):
    from stalwart.chaos.drill import config_drift

    ref, run = tmp_path / "ref", tmp_path / "run"
    for d, extra in ((ref, ""), (run, "max_mb = 4.0\n")):
        d.mkdir()
        (d / "config.toml").write_text(f'[run]\ndir = "{d}"\n[data]\nseq_len = 64\n{extra}'
                                       f'[fault]\nlighthouse = "127.0.0.1:{len(extra)}"\n')
    assert config_drift(ref, run) == ["data.max_mb"]
    assert config_drift(ref, ref) == [] and config_drift(ref, tmp_path / "none") == []
