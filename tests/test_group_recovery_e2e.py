"""fault.group_recovery through the CLI: 3 replica groups of one process; faults in one group, in two at
once and in all three, a stop and a hang, injected and sent from outside. The survivors' processes are never restarted,
and every step's loss, weights and optimizer state equal an undisturbed run's."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import TINY_RUN, popen_cli, read_metrics, run_cli

from stalwart.metrics.records import read_jsonl

STEPS = 100
JOB = [*TINY_RUN, "--training.global_batch", "6", "--training.micro_batch", "2", "--training.elastic_exact", "true",
       "--nproc-per-node", "3", "--parallelism.dp_replicate", "3", "--training.steps", str(STEPS),
       "--checkpoint.interval", "0"]
GROUPED = [*JOB, "--fault.group_recovery", "true", "--checkpoint.memory_interval", "5",
           "--fault.heartbeat_timeout_s", "2", "--fault.rejoin_timeout_s", "60"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("groups") / "reference"
    run_cli("train", *JOB, "--run.dir", str(run))
    return run


def _group(run: Path, g: int) -> Path:
    return run if g == 0 else run / "groups" / str(g)


def _state(run: Path) -> dict[int, tuple]:
    """step -> (loss, weights, optimizer state) as logged."""
    return {m["step"]: (m["loss"], m["fingerprint_parts"]["params"], m["fingerprint_parts"]["optim"])
            for m in read_metrics(run) if "fingerprint_parts" in m}


def _assert_bitwise(reference: Path, run: Path) -> None:
    want = _state(reference)
    assert sorted(want) == list(range(1, STEPS + 1))
    for g in range(3):
        got = _state(_group(run, g))
        assert got and all(got[s] == want[s] for s in got), f"group {g} differs first at step " + str(
            min(s for s in got if got[s] != want[s]))
    # Some group logged every step: the survivors never stopped.
    assert any(sorted(_state(_group(run, g))) == sorted(want) for g in range(3))


def _restarts(run: Path, g: int) -> int:
    return sum(e["event"] == "restart" for e in read_jsonl(_group(run, g) / "events.jsonl"))


@pytest.mark.e2e
def test_injected_faults_in_one_two_and_all_groups_stay_bitwise(reference, tmp_path):
    run = tmp_path / "faults"
    plan = ("kill:rank=2,step=8;"                                      # one group
            "kill:rank=1,step=30;kill:rank=2,step=30;"                 # two at once: group 0 redoes both
            "kill:rank=0,step=60;kill:rank=1,step=60;kill:rank=2,step=60")  # all: whole-job fallback
    run_cli("train", *GROUPED, "--run.dir", str(run), "--fault.inject", plan, "--launch.max_restarts", "5")
    _assert_bitwise(reference, run)
    events = read_jsonl(run / "events.jsonl")
    lost = [e for e in events if e["event"] == "group_epoch" and e["reason"] == "group_lost"]
    assert {e["lost"] for e in lost} >= {1, 2}
    assert any(e["event"] == "group_whole_job_fallback" for e in events)
    redone = [e for e in events if e["event"] == "group_step_redone"]
    assert {e["step"] for e in redone} >= {8, 30}
    transfers = [e for e in events if e["event"] == "group_transfer"]
    assert transfers and all(e["fingerprint_checked"] and e["bytes"] > 0 for e in transfers)
    # Group 0 was restarted only by the fault that took every group; groups 1 and 2 by theirs.
    assert (_restarts(run, 0), _restarts(run, 1), _restarts(run, 2)) == (1, 2, 3)


@pytest.mark.e2e
def test_a_group_stopped_from_outside_is_replaced_while_the_others_keep_their_processes(reference, tmp_path):
    """Group 1 stopped (SIGSTOP) from outside, past the heartbeat timeout; group 2 hangs in step 50 (its
    heartbeat goes on) past the progress watchdog, while group 0 waits on it in the exchange: only the
    groups hit are restarted."""
    run = tmp_path / "sigstop"
    proc = popen_cli("train", *GROUPED, "--run.dir", str(run), "--metrics.progress", "false",
                     "--fault.inject", "hang:rank=2,step=50", "--fault.progress_timeout_s", "4",
                     stdout=open(tmp_path / "out.txt", "w"), stderr=open(tmp_path / "err.txt", "w"))
    beats = {g: _group(run, g) / "ft" / "heartbeat" / "rank-0.json" for g in range(3)}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done = [json.loads(p.read_text()).get("step", 0) if p.is_file() else 0 for p in beats.values()]
        if min(done) >= 15:
            break
        time.sleep(0.05)
    pids = {g: json.loads(p.read_text())["pid"] for g, p in beats.items()}
    os.kill(pids[1], signal.SIGSTOP)  # past fault.heartbeat_timeout_s: group 1's supervisor replaces it
    assert proc.wait(timeout=240) == 0, (tmp_path / "err.txt").read_text()[-3000:]
    after = {g: json.loads(p.read_text())["pid"] for g, p in beats.items()}
    assert after[0] == pids[0] and after[1] != pids[1] and after[2] != pids[2]
    assert (_restarts(run, 0), _restarts(run, 1), _restarts(run, 2)) == (0, 1, 1)
    kinds = [[e["kind"] for e in read_jsonl(_group(run, g) / "events.jsonl") if e["event"] == "failure"]
             for g in (1, 2)]
    assert kinds == [["unresponsive"], ["hang"]]
    _assert_bitwise(reference, run)


@pytest.mark.e2e
def test_groups_on_separate_hosts_through_the_lighthouse_address(reference, tmp_path):
    """Three emulated hosts (network namespaces, links shaped to 100 Mbit/s), one group each; group 0's
    host serves the lighthouse at its address; a kill -9 on host 2 restarts only host 2's group."""
    import subprocess
    import sys

    from stalwart.comm.netns import IFNAME, NetnsCluster, unavailable_reason

    if unavailable_reason():
        pytest.skip(unavailable_reason())
    run = tmp_path / "hosts"
    at = GROUPED.index("--nproc-per-node")
    args = GROUPED[:at] + GROUPED[at + 2:]
    with NetnsCluster(hosts=3, rate_mbit=100) as cluster:
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFNAME, PYTHONPATH=str(Path.cwd()))
        logs = [open(tmp_path / f"host{g}.txt", "w") for g in range(3)]
        procs = [subprocess.Popen(["ip", "netns", "exec", cluster.names[g], sys.executable, "-m", "stalwart", "train",
                                   *args, "--nproc-per-node", "1", "--run.dir", str(run), "--fault.replica_group",
                                   str(g), "--fault.lighthouse", f"{cluster.addr(0)}:29611"],
                                  env=env, stdout=logs[g], stderr=subprocess.STDOUT) for g in range(3)]
        try:
            beat = _group(run, 2) / "ft" / "heartbeat" / "rank-0.json"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and all(p.poll() is None for p in procs):
                b = json.loads(beat.read_text()) if beat.is_file() else {}
                if b.get("step", 0) >= 20:
                    break
                time.sleep(0.05)
            assert b.get("step", 0) >= 20, [(tmp_path / f"host{g}.txt").read_text()[-2000:] for g in range(3)]
            os.kill(b["pid"], signal.SIGKILL)
            codes = [p.wait(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert codes == [0, 0, 0], [(tmp_path / f"host{g}.txt").read_text()[-2000:] for g in range(3)]
    assert (_restarts(run, 0), _restarts(run, 1), _restarts(run, 2)) == (0, 0, 1)
    events = read_jsonl(run / "events.jsonl")
    assert any(e["event"] == "group_lost" and e["group"] == 2 and e["cause"] == "signal" for e in events)
    assert any(e["event"] == "group_transfer" and e["role"] == "source" for e in events)
    _assert_bitwise(reference, run)


@pytest.mark.e2e
@pytest.mark.parametrize("extra,says", [
    (["--parallelism.dp_replicate", "1"], "dp_replicate to 2 or more"),
    (["--training.elastic_exact", "false"], "set --training.elastic_exact true"),
    (["--parallelism.dp_shard", "2", "--nproc-per-node", "6"], "holds the whole model"),
    (["--fault.replica_group", "1", "--nproc-per-node", "1"], "give the lighthouse's address"),
    (["--fault.replica_group", "1", "--nproc-per-node", "1", "--fault.lighthouse", "nowhere"], "must be HOST:PORT"),
    (["--fault.replica_group", "3", "--nproc-per-node", "1", "--fault.lighthouse", "127.0.0.1:1"], "must be below"),
])
def test_a_group_job_that_cannot_run_is_one_line_and_exit_2(tmp_path, extra, says):
    proc = run_cli("train", *GROUPED, "--run.dir", str(tmp_path / "bad"), *extra, check=False, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.e2e
def test_sigterm_saves_every_group_and_the_rerun_resumes_bit_for_bit(reference, tmp_path):
    """SIGTERM to the job's launcher and, as a scheduler that signals every process would, to a worker
    too: every group saves the step it is in, exit 75; the same command resumes bit for bit."""
    run = tmp_path / "preempt"
    proc = popen_cli("train", *GROUPED, "--run.dir", str(run), "--metrics.progress", "false",
                     stdout=open(tmp_path / "out.txt", "w"), stderr=open(tmp_path / "err.txt", "w"))
    beat = _group(run, 1) / "ft" / "heartbeat" / "rank-0.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        b = json.loads(beat.read_text()) if beat.is_file() else {}
        if b.get("step", 0) >= 30:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(b["pid"], signal.SIGTERM)
    assert proc.wait(timeout=120) == 75, (tmp_path / "err.txt").read_text()[-3000:]
    saved = [sorted(p.name for p in (_group(run, g) / "checkpoints").glob("step-*")) for g in range(3)]
    assert all(saved), saved
    run_cli("train", *GROUPED, "--run.dir", str(run))
    _assert_bitwise(reference, run)
