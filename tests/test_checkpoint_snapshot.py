"""In-memory snapshots: blob format, own/peer recovery across real processes, and bit-identical resume
after the whole process group is killed."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY_RUN, assert_same_states, popen_cli, run_cli
from stalwart.checkpoint.inspect import digest
from stalwart.checkpoint.blob import SnapshotError, deserialize, serialize
from stalwart.checkpoint.snapshot import SnapshotStore
from stalwart.paths import RunPaths
from test_checkpoint_unit import tiny, train_step


def _state(model, opt):
    """A deep copy of everything a restore must bring back: weights, optimizer state and hyper-parameters."""
    return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})


def _same(a, b) -> bool:
    """Bit-for-bit equality of two nested states: the same keys everywhere, tensors of the same dtype and
    shape with equal values (torch.equal), plain values equal (==)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
            _same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.unit
def test_blob_round_trip_and_corruption():
    state = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor(3.0),
             "c": torch.ones(2, dtype=torch.bfloat16), "g": [{"betas": (0.9, 0.95), "lr": 1e-3, "n": None}]}
    blob = serialize(state)
    back = deserialize(blob)
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"], state["b"])
    assert back["c"].dtype == torch.bfloat16 and back["g"] == state["g"]
    assert isinstance(back["g"][0]["betas"], tuple)
    flipped = bytearray(blob)
    flipped[-3] ^= 1
    with pytest.raises(SnapshotError, match="checksum"):
        deserialize(bytes(flipped), "snap")
    with pytest.raises(SnapshotError, match="checksum"):
        deserialize(blob[:-10], "snap")
    with pytest.raises(SnapshotError, match="not a Stalwart snapshot"):
        deserialize(pickle.dumps({"x": 1}), "snap")


@pytest.mark.unit
def test_single_rank_store_restores_bit_identically(tmp_path):
    model, opt = tiny()
    for s in range(1, 4):
        train_step(model, opt, s)
    rng = torch.get_rng_state()
    store = SnapshotStore(tmp_path / "job", 0, 1)
    size = store.save(3, model, opt, {"tokens_seen": 3})
    assert store.memory_bytes == size  # one process: no peer copy
    before = _state(model, opt)
    train_step(model, opt, 4)
    store.save(4, model, opt, {"tokens_seen": 4})
    assert [p.name for p in (tmp_path / "job" / "rank-0" / "own").iterdir()] == ["step-4.snap"]  # bounded
    fresh, fresh_opt = tiny(seed=9)
    torch.manual_seed(123)
    assert store.newest_complete_step() == 4
    # Restore the step-3 state instead through a second store holding it.
    store3 = SnapshotStore(tmp_path / "job3", 0, 1)
    m3, o3 = tiny()
    for s in range(1, 4):
        train_step(m3, o3, s)
    torch.set_rng_state(rng)
    store3.save(3, m3, o3, {"tokens_seen": 3})
    torch.manual_seed(5)
    st = store3.load(3, fresh, fresh_opt)
    assert st == {"step": 3, "tokens_seen": 3}
    assert before["optim"]["state"], "AdamW state is empty: the comparison below would prove nothing"
    assert _same(_state(fresh, fresh_opt), before)
    assert not _same(_state(fresh, fresh_opt), _state(model, opt))  # step 3's numbers, not step 4's
    assert torch.equal(torch.get_rng_state(), rng)
    # The restored optimizer continues exactly like the original.
    assert train_step(fresh, fresh_opt, 4) == train_step(m3, o3, 4)
    # A corrupted own copy makes the snapshot unavailable.
    f = tmp_path / "job" / "rank-0" / "own" / "step-4.snap"
    data = bytearray(f.read_bytes())
    data[100] ^= 1
    f.write_bytes(bytes(data))
    assert store.newest_complete_step() is None
    store.clear()
    assert not (tmp_path / "job").exists()


def _peer_worker(rank: int, world: int, init: str, job: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, opt = tiny(seed=rank)  # each rank's "shard" differs
        for s in range(1, 3):
            train_step(model, opt, s + 10 * rank)
        store = SnapshotStore(job, rank, world, local_world_size=world, layout="test")
        size = store.save(2, model, opt, {"tokens_seen": 2})
        saved = _state(model, opt)
        result = {"peer": store.peer, "source": store.source, "size": size, "mem": store.memory_bytes}
        dist.barrier()
        if rank == 1:  # rank 1's own copy is lost (e.g. its host was replaced)
            shutil.rmtree(Path(job) / "rank-1" / "own")
        dist.barrier()
        result["newest"] = store.newest_complete_step()
        fresh, fresh_opt = tiny(seed=42)
        st = store.load(2, fresh, fresh_opt)
        result["restored_equal"] = _same(_state(fresh, fresh_opt), saved)
        result["trainer"] = st
        result["own_rewritten"] = (Path(job) / f"rank-{rank}" / "own" / "step-2.snap").is_file()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_lost_own_copy_is_restored_from_the_peer(tmp_path):
    import torch.multiprocessing as mp

    job = tmp_path / "job"
    mp.start_processes(_peer_worker, args=(2, f"file://{tmp_path / 'store'}", str(job), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["peer"], r0["source"], r1["peer"], r1["source"]) == (1, 1, 0, 0)
    assert r0["mem"] == r0["size"] + r1["size"]  # own + peer copy: 2x the local shard state
    assert r0["newest"] == r1["newest"] == 2
    assert r0["restored_equal"] and r1["restored_equal"]
    assert r1["trainer"] == {"step": 2, "tokens_seen": 2} and r1["own_rewritten"]


@pytest.mark.unit
def test_peer_is_same_local_rank_on_the_next_host():
    store = SnapshotStore("/nonexistent", rank=3, world_size=16, local_world_size=8)
    assert store.peer == 11 and store.source == 11
    assert SnapshotStore("/nonexistent", rank=15, world_size=16, local_world_size=8).peer == 7
    assert SnapshotStore("/nonexistent", rank=3, world_size=4, local_world_size=4).peer == 0


# ---------------------------------------------------------------------------- end to end
def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _train_args(run_dir, steps, *extra):
    return ["train", "--run.dir", str(run_dir), *TINY_RUN, "--nproc-per-node", "2",
            "--training.steps", str(steps), *extra]


def _a_new_run_never_resumes_a_deleted_runs_snapshots(run: Path, snap_dir: Path, tmp_path: Path) -> None:
    """``run`` was killed with snapshots in ``snap_dir``: delete it (kept aside) and start a new run at its
    path, under the launcher (2 workers) and as one process: each starts fresh, and drops the leftovers.
    Then the killed run and its snapshots are put back as they were."""
    kept, kept_snaps = tmp_path / "killed-kept", tmp_path / "killed-snapshots"
    run.rename(kept)
    shutil.copytree(snap_dir, kept_snaps)
    for nproc in ("2", "1"):
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(snap_dir, ignore_errors=True)
        shutil.copytree(kept_snaps, snap_dir)  # what the killed run left in RAM
        run_cli("train", "--run.dir", str(run), *TINY_RUN, "--nproc-per-node", nproc, "--training.steps", "1",
                "--checkpoint.memory_interval", "3", "--checkpoint.interval", "0", "--eval.at_start", "false",
                "--sample.max_new_tokens", "0")
        events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
        assert not [e for e in events if e["event"] == "resumed"], (nproc, events)
        assert not list(snap_dir.glob("rank-*/*/step-*.snap")), nproc  # the leftovers are gone
    shutil.rmtree(run)
    kept.rename(run)
    shutil.rmtree(snap_dir, ignore_errors=True)
    shutil.copytree(kept_snaps, snap_dir)


@pytest.mark.e2e
def test_resume_from_memory_after_killing_the_process_group_is_bit_identical(tmp_path, request):
    steps = 24
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_cli(*_train_args(straight, steps))
    snap_dir = RunPaths(killed).snapshots()
    shutil.rmtree(snap_dir, ignore_errors=True)
    request.addfinalizer(lambda: shutil.rmtree(snap_dir, ignore_errors=True))  # RAM, even if the test fails
    proc = popen_cli(*_train_args(
        killed, steps, "--checkpoint.memory_interval", "3", "--checkpoint.interval", "0"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while True:  # wait until both ranks hold a snapshot of step >= 6 (and their peer's copy)
            own = list(snap_dir.glob("rank-*/own/step-*.snap")) + list(snap_dir.glob("rank-*/peer/step-*.snap"))
            if len(own) == 4 and min(int(p.stem.split("-")[1]) for p in own) >= 6:
                break
            assert proc.poll() is None, "training finished before it could be killed"
            assert time.time() < deadline
            time.sleep(0.02)
    finally:
        # The whole worker group, abruptly: the launcher and every descendant (the elastic agent may
        # start workers in their own sessions, so a process-group kill is not enough).
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    assert not (killed / "checkpoints").exists() or not list((killed / "checkpoints").glob("step-*"))
    _a_new_run_never_resumes_a_deleted_runs_snapshots(killed, snap_dir, tmp_path)
    shutil.rmtree(snap_dir / "rank-1" / "own", ignore_errors=True)  # rank 1's copy must come from its peer
    # NOTE: the killed launch's heartbeat files would look like a hung worker to the new supervisor.
    shutil.rmtree(killed / "ft" / "heartbeat", ignore_errors=True)
    run_cli(*_train_args(killed, steps, "--checkpoint.memory_interval", "3", "--checkpoint.interval", "0"))
    events = [json.loads(x) for x in (killed / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed and resumed[0]["source"] == "memory" and resumed[0]["step"] >= 6
    assert_same_states(straight, killed)  # exact, every step (re-run steps included)
    a, b = straight / "checkpoints" / f"step-{steps}", killed / "checkpoints" / f"step-{steps}"
    assert digest(a, "model.") == digest(b, "model.") and digest(a, "optim.") == digest(b, "optim.")
    assert not snap_dir.exists()  # a finished run frees its snapshots
