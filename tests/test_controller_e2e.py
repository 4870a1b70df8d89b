"""`stalwart train --controller` end to end: one controller process drives two Monarch trainer actors
(FSDP over their own gloo group). One uninterrupted SPMD run is the reference; one controller run
meets an exception, a kill -9 and a hang, each in a different actor and step, and must still end
bit for bit where the SPMD run ends, without any actor loading a checkpoint from disk. Snapshots are
kept every 3 steps, so two of the recoveries replay a journaled step and check it bit for bit.
A second controller run is killed itself (SIGKILL) twice, mid-update and at a snapshot, and the same
command run again resumes it each time, ending equal to the same reference."""

import json

import pytest
import torch
from conftest import TINY_RUN, assert_same_states, run_cli, step_losses
from controller_kill import has, journal, kill_when, start

from stalwart.checkpoint.inspect import digest
from stalwart.controller.recovery import hang_bound

pytest.importorskip("monarch.actor")
pytestmark = pytest.mark.e2e

STEPS = 8
STEP_TIMEOUT_S = 4.0  # a tiny step takes ~0.1-0.5 s on a loaded 2-core machine
COMMON = ["--training.steps", str(STEPS), "--checkpoint.memory_interval", "3", "--checkpoint.interval", "0",
          "--checkpoint.keep_last", "0", "--nproc-per-node", "2"]


def events(run_dir, name=None):
    evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in evs if name is None or e["event"] == name]


@pytest.fixture(scope="module")
def spmd(tmp_path_factory):
    """The uninterrupted SPMD run every controller run must end equal to."""
    run = tmp_path_factory.mktemp("spmd") / "run"
    run_cli("train", "--run.dir", str(run), *TINY_RUN, *COMMON, timeout=400)
    return run


def test_controller_equals_spmd_and_recovers_from_memory_and_journal(tmp_path, spmd):
    ctl = tmp_path / "controller"
    proc = run_cli("train", "--controller", "--run.dir", str(ctl), *TINY_RUN, *COMMON,
                   "--controller.step_timeout_s", str(STEP_TIMEOUT_S),
                   "--fault.inject", "exception:rank=0,step=4;kill:rank=1,step=5;hang:rank=1,step=8", timeout=400)
    assert "3 recoveries" in proc.stdout

    # Bit for bit: every step's loss (the journal's first result of each step is the pre-failure one,
    # metrics.jsonl's last the replayed one), and the final weights and optimizer state.
    ref = step_losses(spmd)
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert_same_states(spmd, ctl)  # and every step's state fingerprint (weights, optimizer, RNG, data)
    journal = [json.loads(x) for x in (ctl / "controller" / "journal.jsonl").read_text().splitlines()]
    first = {}
    for e in journal:
        if e["cmd"] == "applied":
            first.setdefault(e["step"], e["loss"])
    assert first == ref
    assert [e["seq"] for e in journal] == list(range(1, len(journal) + 1))
    a, b = spmd / "checkpoints" / f"step-{STEPS}", ctl / "checkpoints" / f"step-{STEPS}"
    assert digest(a, "model.") == digest(b, "model.") and digest(a, "optim.") == digest(b, "optim.")

    # Each failure reached the controller with the actor named, its cause, and within its bound.
    fails = events(ctl, "failure")
    assert [(f["injected"], f["kind"], f["rank"], f["step"]) for f in fails] == [
        ("exception", "exception", 0, 4), ("kill", "killed", 1, 5), ("hang", "hang", 1, 8)]
    exc, kill, hang = (f["detection_latency_s"] for f in fails)
    # The exception comes with the reply; a death is reported by Monarch (polled every 0.5 s) or, when
    # its report does not come, seen in /proc and named after supervision_poll_s + 0.25 s.
    assert exc < 2.0 and kill < 2.0
    assert hang <= hang_bound(STEP_TIMEOUT_S) + 1.0
    detail = {(f["rank"], f["cause"]): f["detail"] for f in events(ctl, "controller_failure") if f["root"]}
    assert "InjectedFault" in detail[(0, "exception")] and "Traceback" in detail[(0, "exception")]
    assert detail[(1, "killed")] == "killed by signal 9 (SIGKILL)" or "is gone" in detail[(1, "killed")]

    # Recovery from the in-memory snapshots plus the journal; the survivors kept their processes, and no
    # actor loaded a checkpoint from disk (none existed before the final one: checkpoint.interval = 0).
    # Steps 4 and 7 were replayed (checked against the journal), and each failed step issued again.
    recs = events(ctl, "controller_recovered")
    assert [(r["failed"], r["survivors"], r["source"], r["restored_step"], r["replay"]) for r in recs] == [
        ([0], [1], "memory", 3, 1), ([1], [0], "memory", 3, 2), ([1], [0], "memory", 6, 2)]
    assert [e["replay"] for e in journal if e["cmd"] == "recovery"] == [1, 2, 2]
    assert all(set(r["disk_loads"].values()) == {0} for r in recs)
    pids = {}
    for e in events(ctl, "controller_actor"):
        if e["phase"] == "joined":
            pids.setdefault(e["rank"], []).append(e["pid"])
    assert pids[1][0] == pids[1][1] and pids[0][1] == pids[0][2] == pids[0][3]  # survivors: same process
    assert pids[0][0] != pids[0][1] and len(set(pids[1])) == 3  # the failed ones: replaced
    assert not [e for e in events(ctl, "resumed") if e["source"] != "memory"]

    # The controller's view is in events.jsonl, and goodput accounts for its recoveries.
    assert events(ctl, "controller_start") and events(ctl, "controller_health")
    (done,) = events(ctl, "controller_finished")
    assert done["recoveries"] == 3 and done["dispatch_overhead_s"] > 0
    out = run_cli("goodput", str(ctl)).stdout
    assert "(injected kill)" in out and "(injected hang)" in out


def test_a_killed_controller_resumes_from_memory_and_checks_the_journal(tmp_path, spmd):
    """kill -9 of the controller mid-update (step 5 sent), then again at the snapshot of step 6: its
    actors die with it, and the same command resumes from the newest in-memory snapshot that survived
    in /dev/shm, computes again the journaled steps after it (each checked against its batch and its
    lr, loss, grad_norm) and ends bit for bit where the uninterrupted run ends. Steps 4-8 are slowed
    (a sleep, no change in the numbers) so each kill lands where it is aimed."""
    ctl = tmp_path / "controller"
    cmd = ["train", "--controller", "--run.dir", str(ctl), *TINY_RUN, *COMMON,
           "--fault.inject", "slow:rank=0,factor=15,steps=4-8"]
    kill_when(start(*cmd), ctl, lambda j: has(j, "step", 5) and not has(j, "applied", 5))
    kill_when(start(*cmd), ctl, lambda j: has(j, "applied", 6))
    proc = run_cli(*cmd, timeout=400)
    assert "0 recoveries" in proc.stdout

    assert step_losses(ctl) == step_losses(spmd)
    a, b = spmd / "checkpoints" / f"step-{STEPS}", ctl / "checkpoints" / f"step-{STEPS}"
    assert digest(a, "model.") == digest(b, "model.") and digest(a, "optim.") == digest(b, "optim.")

    assert run_cli("compare", str(spmd), str(ctl)).returncode == 0  # every step's state fingerprint too

    entries = journal(ctl)
    assert all("fingerprint" in e for e in entries if e["cmd"] == "applied")  # checked when computed again
    sessions = [e for e in entries if e["cmd"] == "session"]
    assert len(sessions) == 3 and len({e["config"] for e in sessions}) == 1
    # Session 2 resumed from the snapshot of step 3 and checked step 4; session 3 from the newest
    # snapshot complete on both actors (step 6, or step 3 if the kill cut the snapshot of step 6 short)
    # and checked every step up to 6.
    assert [(s["step"], s["source"], s["checks"]) for s in sessions[:2]] == [(0, "init", 0), (3, "memory", 1)]
    assert sessions[2]["step"] in (3, 6) and sessions[2]["source"] == "memory"
    assert sessions[2]["checks"] == 6 - sessions[2]["step"]
    (done,) = events(ctl, "controller_finished")
    assert done["resumed_checks"] == sessions[2]["checks"]
    assert not list(ctl.glob("checkpoints/step-[1-7]"))  # no disk checkpoint before the final one



@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_the_machine_lacks_is_one_line_before_any_actor(tmp_path):
    """``--controller --training.device cuda`` on a CPU-only machine: the preflight refuses it in one
    line naming the setting, exit 2, before an actor is spawned or the run directory is made."""
    run = tmp_path / "run"
    proc = run_cli("train", "--controller", "--run.dir", str(run), *TINY_RUN, "--training.device", "cuda",
                   "--nproc-per-node", "2", check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "training.device cuda" in lines[0] and "Traceback" not in proc.stderr
    assert "Monarch" not in proc.stdout + proc.stderr and not run.exists()
