"""Fault tolerance, pure logic: plans, detectors, restart policy and supervisor (no processes)."""

import json

import pytest

from stalwart.config import ConfigError, load
from stalwart.config.fault import validate_timeouts
from stalwart.config.job import JobConfig
from stalwart.ft.detect import (
    BUDGET_EXHAUSTED,
    CRASH_LOOP,
    RESTART,
    Beat,
    RestartPolicy,
    SpikeDetector,
    StragglerDetector,
    check_heartbeat,
)
from stalwart.ft.plan import (
    ChaosSchedule,
    FaultPlanError,
    fired_ids,
    mark_fired,
    parse_plan,
    pending,
)
from stalwart.ft.supervisor import Supervisor, newest_state_step
from stalwart.paths import RunPaths

pytestmark = pytest.mark.unit

PLAN = ("kill:rank=1,step=17;hang:rank=0,step=30;nan:step=40;slow:rank=1,factor=3,steps=50-80;"
        "exception:rank=0,step=60;corrupt_checkpoint:step=50")


def test_parse_plan_typed():
    faults = parse_plan(PLAN)
    assert [f.kind for f in faults] == ["kill", "hang", "nan", "slow", "exception", "corrupt_checkpoint"]
    kill, _, nan, slow, *_ = faults
    assert (kill.rank, kill.step, kill.once) == (1, 17, True)
    assert (nan.rank, nan.step) == (0, 40)
    assert (slow.rank, slow.factor, slow.first, slow.last) == (1, 3.0, 50, 80)
    assert parse_plan("") == [] and parse_plan(" ; ") == []
    assert not parse_plan("exception:step=2,once=0")[0].once


@pytest.mark.parametrize("bad,msg", [
    ("kil:step=3", "did you mean 'kill'"),
    ("kill:rank=1", "needs step=N"),
    ("kill:step=x", "not an integer"),
    ("kill:step=0", "must be >= 1"),
    ("kill:stp=3", "takes once, rank, step"),
    ("slow:rank=1,factor=3", "needs factor=F and steps=A-B"),
    ("slow:factor=0.5,steps=1-2", "factor must be >= 1"),
    ("slow:factor=2,steps=5-2", "is empty"),
    ("kill:step", "expected key=value"),
])
def test_parse_plan_errors(bad, msg):
    with pytest.raises(FaultPlanError, match=msg):
        parse_plan(bad)


def test_fired_faults_are_not_fired_again(tmp_path):
    faults = parse_plan("kill:rank=1,step=3;exception:step=5,once=0")
    paths = RunPaths(tmp_path)
    mark_fired(paths, faults[0], 3, 1.0)
    mark_fired(paths, faults[1], 5, 2.0)
    assert fired_ids(paths) == {"0-kill", "1-exception"}
    assert [f.kind for f in pending(faults, fired_ids(paths))] == ["exception"]  # once=0 repeats


def test_chaos_schedule_is_seeded():
    a, b = ChaosSchedule(60, seed=3, world_size=4), ChaosSchedule(60, seed=3, world_size=4)
    da, db = a.due(3600), b.due(3600)
    assert da == db and 30 < len(da) < 100  # ~60 faults in an hour at MTBF 60 s
    assert all(k in ("kill", "hang", "exception") and 0 <= r < 4 for _, k, r in da)
    assert a.due(3600) == []  # each fault is returned once
    assert ChaosSchedule(60, seed=4).due(3600) != ChaosSchedule(60, seed=3).due(3600)


def test_timeouts_must_be_ordered():
    validate_timeouts(0.5, 10, 120, 300, 900)
    with pytest.raises(ConfigError, match="progress_timeout_s .* must be smaller than fault.collective_timeout_s"):
        validate_timeouts(0.5, 10, 400, 300, 900)
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        load(JobConfig, None, ["--fault.heartbeat_timeout_s", "200"])
    with pytest.raises(FaultPlanError, match="unknown fault kind"):
        load(JobConfig, None, ["--fault.inject", "boom:step=1"])


def beat(step=5, phase="train", progress=100.0, beat_t=100.0, attempt=0):
    return Beat(0, attempt, step, 0, phase, progress, beat_t)


def test_heartbeat_watchdog_bounds():
    kw = {"heartbeat_timeout_s": 3, "progress_timeout_s": 5, "init_timeout_s": 60}
    assert check_heartbeat(beat(), 0, 102.0, 0.0, 0, **kw) is None          # healthy
    hang = check_heartbeat(beat(beat_t=104.9), 0, 105.1, 0.0, 0, **kw)       # beating, no progress for 5.1 s
    assert hang.kind == "hang" and hang.since == 100.0 and hang.step == 5
    dead = check_heartbeat(beat(progress=104, beat_t=100.0), 0, 103.1, 0.0, 0, **kw)
    assert dead.kind == "unresponsive"
    # start-up and the end of training get the init timeout, not the progress timeout
    assert check_heartbeat(beat(phase="init", beat_t=130), 0, 130.0, 0.0, 0, **kw) is None
    assert check_heartbeat(None, 0, 59.0, 0.0, 0, **kw) is None
    assert check_heartbeat(None, 0, 61.0, 0.0, 0, **kw).kind == "hang"
    assert check_heartbeat(beat(attempt=0), 0, 10.0, 0.0, 1, **kw) is None  # a previous attempt's file
    assert check_heartbeat(beat(beat_t=50.0), 0, 120.0, 100.0, 0, **kw) is None  # a previous launch's file


def test_spike_detector():
    d = SpikeDetector(threshold=6, window=16)
    losses = [5.0 - 0.01 * i + (0.02 if i % 3 == 0 else -0.02) for i in range(40)]
    assert all(d.update(x) is None for x in losses)  # a healthy, noisy, decreasing curve: no spike
    z = d.update(9.0)
    assert z is not None and z > 6
    assert d.update(losses[-1]) is None  # the spike did not enter the history
    assert SpikeDetector(0, 16).update(100.0) is None  # off


def test_straggler_detector_names_the_slow_rank():
    d = StragglerDetector(threshold=2.0, window=4)
    found = []
    for i in range(8):
        found += d.update({"forward_backward": [0.10 + 0.01 * (i % 2), 0.31, 0.1, 0.11]})
    assert [(s.rank, s.phase) for s in found] == [(1, "forward_backward")] and found[0].ratio > 2.5
    healthy = StragglerDetector(threshold=2.0, window=4)
    assert not any(healthy.update({"forward_backward": [0.1, 0.1 + 0.04 * (i % 3)]}) for i in range(20))


def test_restart_policy_crash_loop_vs_budget():
    p = RestartPolicy(max_restarts=5, crash_loop_restarts=2, initial_progress=-1)
    assert p.on_failure(-1) == RESTART      # 1 failure without progress
    assert p.on_failure(-1) == CRASH_LOOP   # 2 in a row: do not requeue
    q = RestartPolicy(max_restarts=2, crash_loop_restarts=2, initial_progress=-1)
    assert [q.on_failure(s) for s in (2, 4, 6)] == [RESTART, RESTART, BUDGET_EXHAUSTED]
    r = RestartPolicy(max_restarts=9, crash_loop_restarts=2, initial_progress=0)
    assert [r.on_failure(s) for s in (0, 3, 3, 3)] == [RESTART, RESTART, RESTART, CRASH_LOOP]  # progress resets


class Cfg:
    heartbeat_timeout_s, progress_timeout_s, init_timeout_s = 3.0, 5.0, 60.0
    crash_loop_restarts, chaos_mtbf_s, chaos_seed, chaos_kinds = 2, 0.0, 0, ["kill"]
    exclude_after = 0


def write_beat(run_dir, rank, **kw):
    d = run_dir / "ft" / "heartbeat"
    d.mkdir(parents=True, exist_ok=True)
    rec = {"rank": rank, "attempt": 0, "step": 5, "resumed_step": 0, "phase": "train", "progress_time": 100.0,
           "beat_time": 100.0, **kw}
    (d / f"rank-{rank}.json").write_text(json.dumps(rec))


def test_supervisor_detects_hang_and_records_recovery(tmp_path):
    events = []
    sup = Supervisor(Cfg(), tmp_path, None, 3, [0, 1], lambda name, **kw: events.append({"event": name, **kw}))
    sup.launched(90.0)
    write_beat(tmp_path, 0, beat_time=104.0)
    write_beat(tmp_path, 1, progress_time=99.0, beat_time=104.5)  # stuck in a collective since 99
    assert sup.poll(103.0) is None
    stall = sup.poll(104.1)
    assert stall.kind == "hang" and stall.rank == 1
    assert sup.on_failure(104.1, stall.kind, stall.rank, None, stall) == RESTART
    fail = events[-1]
    assert fail["event"] == "failure" and fail["detection_latency_s"] == pytest.approx(5.1) and fail["step"] == 5
    sup.restarted(110.0, 1.0)
    write_beat(tmp_path, 0, attempt=1, step=4, resumed_step=4, progress_time=111, beat_time=111)
    write_beat(tmp_path, 1, attempt=1, step=5, resumed_step=4, progress_time=112, beat_time=112)
    assert sup.poll(112.0) is None  # rank 0 has not completed a step yet
    write_beat(tmp_path, 0, attempt=1, step=5, resumed_step=4, progress_time=113, beat_time=113)
    sup.poll(113.0)
    rec = events[-1]
    assert rec["event"] == "recovered" and rec["steps_recomputed"] == 1
    assert rec["recovery_s"] == pytest.approx(113 - 104.1) and rec["fault_to_step_s"] == pytest.approx(14)


def test_newest_state_step(tmp_path):
    assert newest_state_step(tmp_path, None) == -1
    (tmp_path / "checkpoints" / "step-4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-4" / "manifest.json").write_text("{}")
    (tmp_path / "checkpoints" / ".tmp-step-6").mkdir()
    assert newest_state_step(tmp_path, None) == 4
    snap = tmp_path / "shm"
    for r in (0, 1):
        (snap / f"rank-{r}" / "own").mkdir(parents=True)
        (snap / f"rank-{r}" / "own" / "step-7.snap").write_bytes(b"x")
    assert newest_state_step(tmp_path, snap) == 7
    (snap / "rank-1" / "own" / "step-7.snap").unlink()  # not every rank has it
    assert newest_state_step(tmp_path, snap) == 4


def test_corrupt_checkpoint_fault_flips_one_byte(tmp_path):
    from stalwart.ft.inject import corrupt_checkpoint
    from stalwart.paths import RunPaths

    paths = RunPaths(tmp_path)
    root = paths.checkpoints
    assert not corrupt_checkpoint(paths, 4)  # not there yet: fires later
    (root / "step-4").mkdir(parents=True)
    shard = root / "step-4" / "__0_0.distcp"
    shard.write_bytes(bytes(100))
    assert not corrupt_checkpoint(paths, 4)  # incomplete (no manifest): not a checkpoint yet
    (root / "step-4" / "manifest.json").write_text("{}")
    assert corrupt_checkpoint(paths, 4)
    data = shard.read_bytes()
    assert data[50] == 0xFF and sum(data) == 0xFF


def test_supervisor_excludes_a_host_after_repeated_failures(tmp_path):
    cfg = Cfg()
    cfg.exclude_after, cfg.crash_loop_restarts = 2, 0
    sup = Supervisor(cfg, tmp_path, None, 9, [0, 1, 2, 3], lambda *a, **k: None, host_size=2)
    sup.launched(0.0)
    assert sup.on_failure(1.0, "crash", 3) == RESTART   # host 1, first failure
    assert sup.on_failure(2.0, "crash", 0) == RESTART   # host 0
    assert sup.on_failure(3.0, "signal", 2) == "exclude" and sup.excluded_host == 1


def test_both_exclusion_writers_share_one_record_format(tmp_path):
    """The supervisor (a host that failed too often) and the guard (a straggler under
    fault.straggler_policy = exclude) append to ft/excluded.json in one format the launcher reads."""
    from stalwart.config.job import FaultConfig
    from stalwart.ft.guard import Guard
    from stalwart.ft.records import read_exclusions, record_exclusion

    paths = RunPaths(tmp_path)
    record_exclusion(paths, 1, 2, "2 failures", restarts_used=3)
    events = []
    guard = Guard(FaultConfig(straggler_policy="exclude", straggler_window=4, host_size=2), paths, 0, 4,
                  lambda name, **kw: events.append({"event": name, **kw}))
    for step in range(1, 5):
        guard._check_stragglers(step, [1.0, 1.0, 1.1, 4.0])  # rank 3 (host 1) is four times slower
    ex = read_exclusions(paths)
    assert [(e["host"], e["ranks"], e["size"], e["source"]) for e in ex] == [
        (1, [2, 3], 2, "supervisor"), (1, [2, 3], 2, "straggler")]
    assert all(set(e) == set(ex[0]) for e in ex) and ex[1]["step"] == 4 and ex[0]["restarts_used"] == 3
    assert [e["rank"] for e in events if e["event"] == "straggler"] == [3]


def test_run_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path, capsys):
    import os
    import socket

    from stalwart.ft.runlock import RunDirLocked, RunLock

    paths = RunPaths(tmp_path / "run")
    with RunLock(paths):
        with pytest.raises(RunDirLocked, match=r"in use by another run \(host .*, PID \d+, started "):
            RunLock(paths).acquire()
    assert not paths.lock.exists()  # released and removed
    paths.lock.write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7, "start": 0}))
    with RunLock(paths):  # nobody holds the flock: the PID is gone
        assert json.loads(paths.lock.read_text())["pid"] == os.getpid()
    assert "taking over the lock" in capsys.readouterr().err


def test_supervisor_blames_the_stopped_rank_and_times_a_kill_from_its_last_heartbeat(tmp_path):
    events = []
    sup = Supervisor(Cfg(), tmp_path, None, 3, [0, 1], lambda name, **kw: events.append({"event": name, **kw}))
    sup.launched(90.0)
    write_beat(tmp_path, 0, progress_time=99.0, beat_time=106.0)  # alive, waiting for rank 1 in a collective
    write_beat(tmp_path, 1, progress_time=99.0, beat_time=101.0)  # SIGSTOPped: its heartbeat stopped too
    stall = sup.poll(106.0)
    assert (stall.rank, stall.kind) == (1, "unresponsive")
    sup.on_failure(106.0, "signal", 0, -9)  # a kill: detected at 106, rank 0's last heartbeat 106 - 0.2
    write_beat(tmp_path, 0, progress_time=99.0, beat_time=105.8)
    sup.on_failure(106.0, "signal", 0, -9)
    assert events[-1]["detection_latency_s"] == pytest.approx(0.2)


def test_threads_follow_omp_num_threads(monkeypatch):
    from stalwart.config.job import LaunchConfig

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert LaunchConfig().threads(1) == 1 and LaunchConfig(threads_per_proc=3).threads(1) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert LaunchConfig().threads(1) >= 1


def test_crash_loop_counts_startup_failures_only_when_the_same_phase_fails_the_same_way():
    from stalwart.ft.detect import FailureSig

    def sig(phase, kind="signal", code=-9, error=None):
        return FailureSig.of(phase, kind, code, error)

    luck = RestartPolicy(max_restarts=10, crash_loop_restarts=3, initial_progress=5)
    kills = [sig("imports"), sig("data"), sig("model"), sig("imports"), sig("group"), sig("restore")]
    assert [luck.on_failure(5, s) for s in kills] == [RESTART] * 6  # kills landing anywhere in start-up
    assert luck.no_progress == 1
    same = RestartPolicy(max_restarts=10, crash_loop_restarts=3, initial_progress=5)
    oom = [sig("model"), sig("model"), sig("model")]  # the same phase killed the same way each time
    assert [same.on_failure(5, s) for s in oom] == [RESTART, RESTART, CRASH_LOOP]
    bug = RestartPolicy(max_restarts=10, crash_loop_restarts=2, initial_progress=5)
    errs = [sig("data", "crash", 1, f"ValueError: bad shard at 0x{7 * i:x} (pid {100 + i})") for i in (1, 2)]
    assert [bug.on_failure(5, s) for s in errs] == [RESTART, CRASH_LOOP]  # numbers and addresses ignored
    mixed = RestartPolicy(max_restarts=10, crash_loop_restarts=2, initial_progress=5)
    assert mixed.on_failure(5, sig("train")) == RESTART
    assert mixed.on_failure(5, sig("data")) == RESTART      # start-up after training: a new run begins
    assert mixed.on_failure(5, sig("train", "crash", 1)) == RESTART
    assert mixed.on_failure(5, sig("train", "crash", 1)) == CRASH_LOOP  # training without progress: counted
    assert mixed.on_failure(9, sig("train")) == RESTART and mixed.no_progress == 0  # progress resets


def test_faults_from_outside_are_never_counted_toward_a_crash_loop():
    """A kill -9 or SIGSTOP from outside, in start-up or in training, neither adds to the row of the job's
    own failures nor ends it; the restart budget bounds them (exit 75). The job's own failures still
    make a loop across them."""
    from stalwart.ft.detect import FailureSig

    def sig(phase, kind="signal", code=-9, error=None, outside=False):
        return FailureSig.of(phase, kind, code, error, outside)

    chaos = RestartPolicy(max_restarts=6, crash_loop_restarts=2, initial_progress=5)
    kills = [sig("first_step", outside=True)] * 4 + [sig("train", outside=True), sig("imports", "unresponsive",
                                                                                     None, outside=True)]
    assert [chaos.on_failure(5, s) for s in kills] == [RESTART] * 6 and chaos.no_progress == 0
    assert chaos.on_failure(5, sig("first_step", outside=True)) == BUDGET_EXHAUSTED  # exit 75, requeue
    bug = RestartPolicy(max_restarts=9, crash_loop_restarts=3, initial_progress=5)
    err = sig("data", "crash", 1, "ValueError: bad shard 3")
    seq = [err, sig("imports", outside=True), err, sig("first_step", outside=True), err]
    assert [bug.on_failure(5, s) for s in seq] == [RESTART] * 4 + [CRASH_LOOP]  # the same error, 3 times
    oom = RestartPolicy(max_restarts=9, crash_loop_restarts=2, initial_progress=5)
    assert [oom.on_failure(5, sig("model")) for _ in range(2)] == [RESTART, CRASH_LOOP]  # the OOM killer's


def test_which_failures_come_from_outside(tmp_path):
    from stalwart.ft.origin import oom_kills, oom_since, outside_fault

    kill = dict(kind="signal", exitcode=-9, own_record=False, self_injected=False, seen_stopped=False)
    assert outside_fault(**{**kill, "oom": False})
    assert not outside_fault(**{**kill, "oom": True})   # the OOM killer sends SIGKILL too: the job's own
    assert not outside_fault(**{**kill, "oom": None})   # no evidence readable: counted, as before
    assert not outside_fault(**{**kill, "own_record": True, "oom": False})      # it recorded its own error
    assert not outside_fault(**{**kill, "self_injected": True, "oom": False})   # fault.inject: sent itself
    assert not outside_fault(**{**kill, "exitcode": -11, "oom": False})         # a segfault is the job's
    stop = {**kill, "kind": "unresponsive", "exitcode": None, "oom": None}
    assert outside_fault(**{**stop, "seen_stopped": True}) and not outside_fault(**stop)  # stale heartbeat
    # The kernel's counters: the host's, and the job's memory cgroup (v1 and v2).
    proc, fs = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    assert oom_kills(proc, fs) == {}
    (proc / "vmstat").write_text("nr_free_pages 10\noom_kill 3\n")
    (proc / "self" / "cgroup").write_text("4:memory:/job/a\n1:cpu:/\n0::/job/b\n")
    (fs / "memory" / "job" / "a").mkdir(parents=True)
    (fs / "memory" / "job" / "a" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (fs / "job" / "b").mkdir(parents=True)
    (fs / "job" / "b" / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    before = oom_kills(proc, fs)
    assert before == {"host": 3, "cgroup": 3}
    assert oom_since(before, before) is False and oom_since(before, {**before, "cgroup": 4}) is True
    assert oom_since({}, before) is None and oom_since(before, {}) is None


def _start_up(run_dir, rank: int, pid: int, t: float, phases=("group", "data", "model", "restore", "first_step")):
    """The start-up record of a worker process that began at ``t`` and reached the last of ``phases``."""
    d = run_dir / "ft" / "startup"
    d.mkdir(parents=True, exist_ok=True)
    rec = {"rank": rank, "attempt": 0, "pid": pid, "process_start": t, "info": {},
           "phases": [[name, t + 0.1 * (i + 1)] for i, name in enumerate(phases)]}
    (d / f"rank-{rank}.json").write_text(json.dumps(rec))


@pytest.mark.parametrize("oom", ["none", "rising", "unreadable"])
def test_kills_in_the_same_start_up_phase_are_a_loop_only_with_oom_evidence(tmp_path, oom):
    """kill -9 of rank 1 in its first step, four attempts in a row, no progress: from outside (the
    kernel's OOM-kill count did not move) they use the restart budget (exit 75); with the count rising
    (the OOM killer) or unreadable they are the same start-up failure again: a crash loop (exit 76).
    Each prints one console line naming the rank, the signal and where it landed."""
    readings = iter({"none": [{"host": 7}] * 9, "rising": [{"host": 7 + i} for i in range(9)],
                     "unreadable": [{}] * 9}[oom])
    cfg = Cfg()
    events, lines = [], []
    sup = Supervisor(cfg, tmp_path, None, 3, [0, 1], lambda name, **kw: events.append({"event": name, **kw}),
                     say=lines.append, read_oom=lambda: next(readings))
    sup.launched(100.0)
    decisions, t = [], 100.0
    for attempt in range(4):
        _start_up(tmp_path, 1, 1000 + attempt, t + 0.5)
        sup.poll(t + 1.0, {0: "running", 1: "running"})
        decisions.append(sup.on_failure(t + 1.2, "signal", 1, -9))
        if decisions[-1] != RESTART:
            break
        sup.restarted(t + 2.0, 0.5)
        t += 10.0
    fails = [e for e in events if e["event"] == "failure"]
    assert all(f["phase"] == "first_step" for f in fails)
    if oom == "none":
        assert decisions == [RESTART] * 3 + [BUDGET_EXHAUSTED]
        assert [f["from_outside"] for f in fails] == [True] * 4 and [f["failures_in_a_row"] for f in fails] == [0] * 4
        assert lines[0] == ("stalwart supervisor: rank 1 was killed by SIGKILL from outside (not counted toward "
                            "fault.crash_loop_restarts) in start-up (first_step); restarting the group")
        assert lines[-1].endswith("; stopping the group")
    else:
        assert decisions == [RESTART, CRASH_LOOP] and not any(f["from_outside"] for f in fails)
        assert lines[0] == "stalwart supervisor: rank 1 was killed by SIGKILL in start-up (first_step); restarting the group"
    assert len(lines) == len(fails)


def test_supervisor_sees_processes_first_hand(tmp_path):
    """A stopped process is found in any phase (start-up included), the killed rank's fault time is the
    last tick it was seen running, and each failure says the phase it hit."""
    from stalwart.ft.records import mark_startup

    events = []
    sup = Supervisor(Cfg(), tmp_path, None, 3, [0, 1], lambda name, **kw: events.append({"event": name, **kw}))
    sup.launched(90.0)
    assert sup.poll(91.0, {0: "running", 1: "running"}) is None  # no heartbeat yet: start-up
    assert sup.poll(92.0, {0: "running", 1: "stopped"}) is None
    stall = sup.poll(95.5, {0: "running", 1: "stopped"})  # stopped > heartbeat_timeout_s (3)
    assert (stall.kind, stall.rank, stall.since) == ("unresponsive", 1, 91.0)
    sup.on_failure(95.5, stall.kind, stall.rank, None, stall)
    assert events[-1]["detection_latency_s"] == pytest.approx(4.5) and events[-1]["phase"] == "imports"
    sup.restarted(100.0, 1.0)
    paths = RunPaths(tmp_path)
    mark_startup(paths, "group", rank=1)
    mark_startup(paths, "data", rank=1)
    sup.poll(101.0, {0: "running", 1: "running"})
    sup.poll(101.1, {0: "running"})  # rank 1 has exited (killed): not running any more
    sup.on_failure(101.2, "signal", 1, -9)
    fail = events[-1]
    assert (fail["rank"], fail["phase"], fail["exitcode"]) == (1, "data", -9)
    assert fail["detection_latency_s"] == pytest.approx(0.2)  # from the last tick it ran, not 0


def test_root_cause_prefers_the_rank_that_failed_first():
    from stalwart.launch.workers import root_cause

    paths = RunPaths("/nonexistent")
    assert root_cause({1: -9}, paths, 0.0, []) == 1  # seen first-hand: only rank 1 had exited
    assert root_cause({0: -15, 1: -9}, paths, 0.0, []) == 1  # torch's SIGTERM to the survivor is not a cause
    assert root_cause({0: 1, 1: -9}, paths, 0.0, [{"rank": 0, "time": 5.0}]) == 0  # an injected fault wins


def test_a_rank_that_left_for_a_peer_points_to_that_peer(tmp_path):
    """Ranks agree on an error (a checkpoint file only rank 1 reads) and leave together; the agent may see
    rank 0's exit (a peer record) before rank 1's. The cause is rank 1, once its record is there, and
    until then the agent is told to wait for it; a failure of rank 0's own is never waited on."""
    from stalwart.ft.records import record_exit
    from stalwart.launch.workers import awaiting_cause, root_cause

    paths = RunPaths(tmp_path)
    record_exit(paths, 0, ValueError("rank 1 could not read it"), user_error=True, peer=True)
    assert awaiting_cause({0: 2}, paths, 0.0)
    assert root_cause({0: 2}, paths, 0.0, []) == 0  # nothing else known yet
    record_exit(paths, 1, ValueError("rng-rank1.json is malformed"), user_error=True)
    assert awaiting_cause({0: 2}, paths, 0.0)  # recorded, but its process has not exited yet
    assert root_cause({0: 2}, paths, 0.0, []) == 1
    assert not awaiting_cause({0: 2, 1: 2}, paths, 0.0)
    assert root_cause({0: 2, 1: 2}, paths, 0.0, []) == 1
    assert not awaiting_cause({}, paths, 0.0)
    own = RunPaths(tmp_path / "own")
    record_exit(own, 0, RuntimeError("out of memory"))
    record_exit(own, 1, RuntimeError("gloo: connection closed"))  # a later, non-peer record of a rank not seen
    assert not awaiting_cause({0: 1}, own, 0.0) and root_cause({0: 1}, own, 0.0, []) == 0


def test_pid_alive_counts_a_zombie_as_dead():
    import subprocess
    import sys
    import time

    from stalwart.procs import pid_alive

    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    exited = subprocess.Popen(["true"])
    try:
        assert pid_alive(running.pid)
        deadline = time.monotonic() + 10  # exited but not reaped: a zombie until wait()
        while pid_alive(exited.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pid_alive(exited.pid)
        exited.wait()
        assert not pid_alive(exited.pid)
    finally:
        running.kill()
        running.wait()


def test_a_forked_worker_starts_like_a_new_process():
    import signal
    import sys

    from stalwart.launch.fork import as_a_new_process, forkable

    train, replica = "stalwart.train", "stalwart.serve.replica"
    assert forkable(sys.executable, ["-u", "-m", train, "--config", "debug"], train) == ["--config", "debug"]
    assert forkable(sys.executable, ["-u", "-m", replica, "--", "--tp", "2"], replica) == ["--", "--tp", "2"]
    assert forkable(sys.executable, ["-u", "-m", train, "--config", "debug"], replica) is None
    assert forkable(sys.executable, ["-u", "-m", "other.module"], train) is None
    assert forkable("/usr/bin/env", ["-m", train], train) is None
    saved = {s: signal.getsignal(s) for s in signal.valid_signals() if callable(signal.getsignal(s))}
    saved.update({s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)})
    try:
        for s in (signal.SIGINT, signal.SIGTERM):  # as torch's agent sets them in the launcher
            signal.signal(s, lambda *a: None)
        as_a_new_process()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
