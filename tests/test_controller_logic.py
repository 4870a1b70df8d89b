"""The single controller's pure parts: the journal's replay planning, failure attribution, and the
goodput accounting of a controller recovery."""

import json

import pytest

from stalwart.controller.journal import Journal, applied_records, newest_snapshot, replay_plan
from stalwart.controller.recovery import (Failure, classify, fault_origin, hang_bound, keeps_survivors,
                                          recovery_source, root_causes)
from stalwart.observe.goodput import account

pytestmark = pytest.mark.unit


def _step(seq, n):
    return {"seq": seq, "cmd": "step", "step": n, "batch": {"batches_served": n - 1}}


def test_replay_plan_takes_each_step_after_the_restore_once_newest_issue_wins():
    entries = [{"seq": 1, "cmd": "session", "step": 0}]
    seq = 1
    for n in (1, 2, 3, 4, 5):
        entries += [_step(seq + 1, n), {"seq": seq + 2, "cmd": "applied", "step": n, "loss": float(n)}]
        seq += 2
    entries.append({"seq": 99, "cmd": "snapshot", "step": 4})
    entries.append(_step(100, 6))  # in flight when an actor failed: no "applied"
    plan = replay_plan(entries, 4)
    assert [e["step"] for e in plan] == [5, 6]
    assert [e["step"] for e in replay_plan(entries, 0)] == [1, 2, 3, 4, 5, 6]
    assert replay_plan(entries, 6) == []
    # A step issued again during a replay: the newer entry is the one replayed.
    entries.append(_step(101, 5) | {"batch": {"batches_served": 4, "again": True}})
    assert replay_plan(entries, 4)[0]["batch"].get("again") is True
    assert applied_records(entries)[3]["loss"] == 3.0 and 6 not in applied_records(entries)
    assert newest_snapshot(entries) == 4


def test_replay_plan_only_covers_this_session_and_refuses_gaps():
    old = [{"seq": 1, "cmd": "session", "step": 0}, _step(2, 1), _step(3, 2)]
    new = old + [{"seq": 4, "cmd": "session", "step": 2}, _step(5, 3)]
    assert [e["step"] for e in replay_plan(new, 2)] == [3]
    with pytest.raises(ValueError, match=r"step\(s\) \[1, 2\]"):
        replay_plan(new, 0)  # the earlier session's steps come from its checkpoint, not this journal


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
    from stalwart.rl.generator import GeneratorActor

    mesh = ActorMesh(TrainerActor, "trainer", 1)  # never spawned: a call that got past the check would fail
    assert [mesh.endpoint_name(e) for e in (TrainerActor.step, TrainerActor.join, TrainerActor.warm)] == [
        "step", "join", "warm"]
    for wrong, named in ((GeneratorActor.load, "GeneratorActor.load"), (TrainerActor._reply, "TrainerActor._reply"),
                         ("step", "'step'")):
        with pytest.raises(TypeError, match=f"{named} is not an endpoint of TrainerActor"):
            mesh.call(wrong, ())
        with pytest.raises(TypeError, match="is not an endpoint of TrainerActor"):
            mesh.call_all(wrong, (), 1.0)

    class Subclass(TrainerActor):  # an inherited endpoint is the subclass's too
        pass

    assert ActorMesh(Subclass, "sub", 0).endpoint_name(TrainerActor.step) == "step"
