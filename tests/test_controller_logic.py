"""The single controller's parts that run without processes: the journal and the replay planning,
failure attribution, the recovery itself over a stand-in mesh, the goodput accounting of a controller
recovery, and the endpoint references a mesh is called with."""

import json

import pytest

from stalwart.controller.journal import (Journal, applied_records, config_key, earlier_results, issued_steps,
                                        newest_snapshot)
from stalwart.controller.recovery import (Failure, classify, fault_origin, hang_bound, keeps_survivors,
                                          recovery_source, root_causes)
from stalwart.controller.replay import divergence, replay_steps
from stalwart.observe.goodput import account

pytestmark = pytest.mark.unit


def _step(seq, n):
    return {"seq": seq, "cmd": "step", "step": n, "batch": {"batches_served": n - 1}}


def test_the_journal_gives_each_steps_newest_issue_and_first_result_this_session():
    entries = [{"seq": 1, "cmd": "session", "step": 0}]
    seq = 1
    for n in (1, 2, 3, 4, 5):
        entries += [_step(seq + 1, n), {"seq": seq + 2, "cmd": "applied", "step": n, "loss": float(n)}]
        seq += 2
    entries.append({"seq": 99, "cmd": "snapshot", "step": 4})
    entries.append(_step(100, 6))  # in flight when an actor failed: no "applied"
    assert sorted(issued_steps(entries)) == [1, 2, 3, 4, 5, 6]
    # A step issued again (retried after a failure): the newer entry is the one replayed.
    entries.append(_step(101, 5) | {"batch": {"batches_served": 4, "again": True}})
    assert issued_steps(entries)[5]["batch"].get("again") is True
    entries.append({"seq": 102, "cmd": "applied", "step": 5, "loss": 9.0})  # a replay's result is no new truth
    assert applied_records(entries)[5]["loss"] == 5.0 and 6 not in applied_records(entries)
    assert newest_snapshot(entries) == 4
    # Only this session: the earlier session's steps come from its checkpoint, not this journal.
    new = entries + [{"seq": 103, "cmd": "session", "step": 5}, _step(104, 6)]
    assert sorted(issued_steps(new)) == [6] and applied_records(new) == {}


def test_a_resumed_session_checks_the_steps_earlier_sessions_of_the_same_settings_completed():
    key, other = config_key({"lr": 1e-3, "seed": 0}), config_key({"lr": 2e-3, "seed": 0})
    assert key == config_key({"seed": 0, "lr": 1e-3}) and key != other
    entries = [{"cmd": "session", "step": 0, "config": key}]
    for n in (1, 2, 3, 4, 5):  # the first controller, killed while step 6 ran
        entries += [_step(0, n), {"cmd": "applied", "step": n, "loss": float(n)}]
    entries += [_step(0, 6), {"cmd": "session", "step": 3, "config": key}]  # resumed at 3, killed in step 4
    entries += [_step(0, 4)]
    got = earlier_results(entries, 3, key)
    assert sorted(got) == [4, 5] and got[5]["applied"]["loss"] == 5.0 and got[4]["issued"]["step"] == 4
    assert earlier_results(entries, 5, key) == {}
    assert earlier_results(entries, 3, other) == {}  # other settings: their results are no evidence
    entries += [_step(0, 4), {"cmd": "applied", "step": 4, "loss": 4.0}, {"cmd": "session", "step": 0, "config": other},
                _step(0, 1), {"cmd": "applied", "step": 1, "loss": 9.0}]
    assert sorted(earlier_results(entries, 0, key)) == [1, 2, 3, 4, 5]
    assert earlier_results(entries, 0, key)[1]["applied"]["loss"] == 1.0
    assert earlier_results(entries, 0, other)[1]["applied"]["loss"] == 9.0


def test_replay_takes_each_step_with_a_result_after_the_restore_and_refuses_gaps():
    applied = {n: {"loss": float(n)} for n in (1, 2, 3, 4, 5)}
    assert replay_steps(applied, 3) == [4, 5] and replay_steps(applied, 0) == [1, 2, 3, 4, 5]
    assert replay_steps(applied, 5) == [] and replay_steps({}, 0) == []
    with pytest.raises(ValueError, match=r"step\(s\) \[3\]"):
        replay_steps({1: {}, 2: {}, 4: {}}, 0)
    assert divergence(4, {"loss": 4.0, "lr": 0.1}, {"loss": 4.0, "lr": 0.1, "seq": 7}, ("loss", "lr")) is None
    said = divergence(4, {"loss": 4.000001, "lr": 0.1}, {"loss": 4.0, "lr": 0.1}, ("loss", "lr"))
    assert said.startswith("replayed step 4 gave {'loss': 4.000001") and "the journal holds {'loss': 4.0" in said


def test_journal_is_append_only_with_continuing_sequence_numbers(tmp_path):
    path = tmp_path / "controller" / "journal.jsonl"
    with Journal(path) as j:
        j.append("session", step=0)
        j.append("step", step=1, batch={"batches_served": 0})
    with path.open("a") as f:
        f.write('{"seq": 3, "cmd": "appl')  # a torn last line (a crash mid-write) is skipped
    with Journal(path) as j:
        assert [e["seq"] for e in j.entries] == [1, 2]
        assert j.append("applied", step=1, loss=1.5)["seq"] == 3
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["cmd"] == "session" and json.loads(lines[-1])["seq"] == 3


def test_failures_are_attributed_to_the_actor_that_caused_them():
    killed = classify(1, "SupervisionError", "The actor ... has failed:\n  the process this actor was running on "
                      "failed: Killed(sig=9)", 10.0)
    assert (killed.cause, killed.detail, killed.root) == ("killed", "killed by signal 9 (SIGKILL)", True)
    peer = classify(0, "ActorError", "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:555", 9.5)
    timeout = classify(0, "ActorError", "RuntimeError: Timed out waiting 4000ms for send operation to complete", 9.0)
    assert peer.cause == timeout.cause == "peer" and not peer.root
    exc = classify(0, "ActorError", "Traceback ...\nValueError: bad batch", 3.0)
    assert exc.cause == "exception" and exc.describe().endswith("(ValueError: bad batch)")
    assert root_causes([peer, killed]) == [killed]
    assert root_causes([peer, timeout]) == [peer, timeout]  # no cause known: every actor is replaced


def test_fault_origin_uses_the_injected_record_once_else_the_earliest_sign():
    root = Failure(1, "killed", "Killed(sig=9)", 10.0, 10.0)
    peer = Failure(0, "peer", "Connection reset by peer", 9.6, 9.6)
    fired = [{"id": "0-kill", "kind": "kill", "rank": 1, "step": 5, "time": 9.5}]
    seen: set[str] = set()
    assert fault_origin(root, [root, peer], fired, 5, seen) == (9.5, "kill")
    assert fault_origin(root, [root, peer], fired, 5, seen) == (9.6, None)  # that record is used up


def test_recovery_choices_and_bounds():
    assert recovery_source("memory", 2) == "memory" and keeps_survivors("memory")
    assert recovery_source("memory", 0) == "disk" and recovery_source("disk", 2) == "disk"
    assert not keeps_survivors("disk")
    assert hang_bound(4.0) == 6.0 and hang_bound(40.0) == 50.0


def test_goodput_accounts_a_controller_recovery():
    """The controller reports a recovery with the run-wide events goodput reads: the failed attempt's
    steps after the restored step are lost, detection and restore are their own buckets."""
    t = 1000.0
    events = [{"time": t, "event": "launch", "engine": "controller"},
              {"time": t + 10.2, "event": "failure", "kind": "killed", "rank": 1, "step": 3, "attempt": 0,
               "fault_time": t + 10.1, "detect_time": t + 10.2, "detection_latency_s": 0.1, "injected": "kill"},
              {"time": t + 12.0, "event": "resumed", "step": 2, "source": "memory", "attempt": 1},
              {"time": t + 12.5, "event": "recovered", "attempt": 1, "recovery_s": 1.9, "fault_to_step_s": 2.4,
               "steps_recomputed": 1},
              {"time": t + 14.0, "event": "supervisor_exit", "engine": "controller"}]
    metrics = [{"step": 1, "loss": 3.0, "step_time_s": 1.0, "time": t + 9.0},
               {"step": 2, "loss": 2.9, "step_time_s": 1.0, "time": t + 10.0},
               {"step": 3, "loss": 2.8, "step_time_s": 0.5, "time": t + 12.5},
               {"step": 4, "loss": 2.7, "step_time_s": 0.5, "time": t + 13.0}]
    g = account(events, metrics)
    assert g["buckets"]["productive"] == pytest.approx(3.0)
    assert g["buckets"]["detection"] == pytest.approx(0.1)
    assert g["buckets"]["restart"] == pytest.approx(1.8)  # detection -> the replayed step's start
    (f,) = g["failures"]
    assert (f["kind"], f["rank"], f["injected"], f["fault_to_step_s"], f["steps_recomputed"]) == (
        "killed", 1, "kill", 2.4, 1)
    assert abs(sum(g["buckets"].values()) - g["wall_s"]) < 1e-9


def test_a_mesh_is_called_through_its_own_actor_classes_endpoints():
    """``mesh.call(TrainerActor.step, ...)``: the reference names the endpoint; another actor's endpoint,
    a method that is no endpoint, or a string is refused at the call, before anything is sent."""
    pytest.importorskip("monarch.actor")
    from stalwart.controller.actor import TrainerActor
    from stalwart.controller.mesh import ActorMesh
    from stalwart.rl.reward import RewardActor

    mesh = ActorMesh(TrainerActor, "trainer", 1)  # never spawned: a call that got past the check would fail
    assert [mesh.endpoint_name(e) for e in (TrainerActor.step, TrainerActor.join, TrainerActor.warm)] == [
        "step", "join", "warm"]
    for wrong, named in ((RewardActor.score, "RewardActor.score"), (TrainerActor._reply, "TrainerActor._reply"),
                         ("step", "'step'")):
        with pytest.raises(TypeError, match=f"{named} is not an endpoint of TrainerActor"):
            mesh.call(wrong, ())
        with pytest.raises(TypeError, match="is not an endpoint of TrainerActor"):
            mesh.call_all(wrong, (), 1.0)

    class Subclass(TrainerActor):  # an inherited endpoint is the subclass's too
        pass

    assert ActorMesh(Subclass, "sub", 0).endpoint_name(TrainerActor.step) == "step"


class _Mesh:
    """A stand-in for ActorMesh: two actors whose kills and replacements are recorded."""

    n = 2

    def __init__(self) -> None:
        self.killed, self.replaced = [], []

    def kill(self, rank):
        self.killed.append(rank)

    def replace(self, rank):
        self.replaced.append(rank)
        return "spare"

    def wait(self, futures, timeout_s, what=""):  # the survivors' commands end once the failed actor is gone
        return {r: None for r in futures}


def _recovery(tmp_path, results, replay=None, **kw):
    """A Recovery over a stand-in mesh; the journal holds steps 1-3 applied (``results``), a snapshot of
    step 2 and step 4 issued; the actors restore step 2; a replay answers ``results`` unless ``replay``."""
    import torch.distributed as dist

    from stalwart.controller.replay import Recovery, RecoveryRole, Restored

    journal = Journal(tmp_path / "journal.jsonl")
    journal.append("session", step=0)
    for n in (1, 2, 3):
        journal.append("step", step=n, batch={"batches_served": n - 1})
        journal.append("applied", step=n, **results[n])
    journal.append("snapshot", step=2)
    journal.append("step", step=4, batch={"batches_served": 3})
    log, attempt, now = [], [0], [100.0]
    role = RecoveryRole(attempt=lambda: attempt[0], rebuild=lambda: attempt.__setitem__(0, attempt[0] + 1),
                        restore=lambda: Restored(2, "memory", {"disk_loads": {0: 0, 1: 0}}),
                        replay=replay or (lambda n: dict(results[n])), matched=("lr", "loss"),
                        keeps_survivors=kw.pop("keeps_survivors", True))
    store = dist.HashStore()
    rec = Recovery(_Mesh(), store, journal, role, lambda name, **f: log.append({"event": name, **f}),
                   max_recoveries=kw.pop("max_recoveries", 3), settle_s=1.0, engine="controller",
                   clock=lambda: now[0], **kw)
    return rec, log, journal, store, attempt, now


def _killed(rank, t=98.0):
    from stalwart.controller.mesh import ActorsFailed

    return ActorsFailed([Failure(rank, "killed", "killed by signal 9 (SIGKILL)", t + 1.0, t)], {}, {1 - rank: None})


RESULTS = {n: {"lr": 0.1 * n, "loss": 3.0 - n / 10} for n in (1, 2, 3)}


def test_a_recovery_replaces_the_failed_actor_restores_replays_checked_and_announces(tmp_path):
    rec, log, journal, store, attempt, now = _recovery(tmp_path, RESULTS)
    assert rec.recover(_killed(1), 4) == 3  # restored 2, step 3 replayed; step 4 is the caller's to retry
    assert (rec.mesh.killed, rec.mesh.replaced, attempt[0], rec.count) == ([1], [1], 1, 1)
    assert store.get("attempt-0/abort") == b"1"  # the old group's rendezvous is given up
    (entry,) = [e for e in journal.entries if e["cmd"] == "recovery"]
    assert (entry["ranks"], entry["cause"], entry["step"], entry["source"], entry["replay"]) == (
        [1], "killed", 2, "memory", 2)  # step 3 replayed, step 4 retried
    names = [e["event"] for e in log]
    assert names[:2] == ["controller_failure", "failure"] and "resumed" in names and "recovered" not in names
    (fail,) = [e for e in log if e["event"] == "failure"]
    assert (fail["kind"], fail["rank"], fail["step"], fail["detection_latency_s"]) == ("killed", 1, 4, 1.0)
    assert rec.recovering
    now[0] = 105.0
    rec.step_done(4)
    assert not rec.recovering
    (done,) = [e for e in log if e["event"] == "recovered"]
    assert (done["steps_recomputed"], done["recovery_s"], done["fault_to_step_s"]) == (2, 2.0, 2.0)
    (mine,) = [e for e in log if e["event"] == "controller_recovered"]
    assert (mine["failed"], mine["survivors"], mine["restored_step"], mine["failed_step"], mine["step"],
            mine["disk_loads"], mine["caught_up_s"]) == ([1], [0], 2, 4, 4, {0: 0, 1: 0}, 7.0)
    rec.step_done(5)  # nothing more to announce
    assert [e["event"] for e in log].count("recovered") == 1


def test_a_replay_that_differs_from_the_journal_stops_the_run(tmp_path):
    from stalwart.controller.replay import ReplayDiverged

    rec, *_ = _recovery(tmp_path, RESULTS, replay=lambda n: {"lr": 0.1 * n, "loss": 2.7000001})
    with pytest.raises(ReplayDiverged, match=r"replayed step 3 gave \{'lr': 0.30000000000000004, 'loss': 2.7000001\}"):
        rec.recover(_killed(0), 4)


def test_a_failure_while_recovering_recovers_again_within_the_budget(tmp_path):
    from stalwart.controller.replay import RecoveriesExhausted

    calls = []

    def replay(n):  # the first replay loses actor 0
        calls.append(n)
        if len(calls) == 1:
            raise _killed(0, 101.0)
        return dict(RESULTS[n])

    rec, log, journal, store, attempt, _ = _recovery(tmp_path, RESULTS, replay=replay)
    assert rec.recover(_killed(1), 4) == 3 and calls == [3, 3]
    assert (rec.count, attempt[0], rec.mesh.replaced) == (2, 2, [1, 0])
    assert store.get("attempt-1/abort") == b"1"  # the attempt the failed recovery built is given up too
    assert [e["step"] for e in log if e["event"] == "failure"] == [4, 3]  # the second failed replaying step 3

    rec, log, *_ = _recovery(tmp_path / "b", RESULTS, max_recoveries=0)
    with pytest.raises(RecoveriesExhausted, match=r"exceeded controller.max_recoveries \(0\): actor 1: killed") as e:
        rec.recover(_killed(1), 4)
    assert e.value.exit_code == 75 and [x["event"] for x in log] == ["controller_failure", "failure"]


def test_a_recovery_without_survivors_replaces_every_actor(tmp_path):
    rec, *_ = _recovery(tmp_path, RESULTS, keeps_survivors=False)
    rec.recover(_killed(1), 4)
    assert rec.mesh.killed == [] and rec.mesh.replaced == [0, 1]  # replace() kills the old process itself
