"""Checkpoint manager in one process: async == sync, corruption refused by name, retention, failed saves."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stalwart.checkpoint import manager as mgr
from stalwart.checkpoint.inspect import digest
from stalwart.checkpoint.manager import CheckpointError, CheckpointManager
from stalwart.config.job import CheckpointConfig
from stalwart.models.flavors import TransformerArgs
from stalwart.models.llama import Transformer
from stalwart.train.init import materialize_and_init

REPO = Path(__file__).resolve().parents[1]
ARGS = TransformerArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64, max_seq_len=16,
                       tie_embeddings=True)


class Events(list):
    def __call__(self, event, **fields):
        self.append({"event": event, **fields})

    def named(self, name):
        return [e for e in self if e["event"] == name]


def tiny(seed: int = 0):
    with torch.device("meta"):
        model = Transformer(ARGS)
    materialize_and_init(model, torch.device("cpu"), seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, seed: int) -> float:
    x = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def manager(root: Path, events=None, **cfg) -> CheckpointManager:
    return CheckpointManager(root, CheckpointConfig(**cfg), 0, 1, events if events is not None else Events())


def saved_run(root: Path, steps=(1, 2), **cfg) -> tuple[CheckpointManager, Events]:
    events = Events()
    m = manager(root, events, async_save=False, keep_last=0, **cfg)
    model, opt = tiny()
    for s in range(1, max(steps) + 1):
        train_step(model, opt, s)
        if s in steps:
            m.save(s, model, opt, {"tokens_seen": s})
    return m, events


# ---------------------------------------------------------------------------- async
@pytest.mark.unit
def test_async_save_equals_sync_and_stages_before_the_optimizer_mutates(tmp_path):
    model, opt = tiny()
    train_step(model, opt, 1)
    sync = manager(tmp_path / "sync", async_save=False)
    sync.save(1, model, opt, {"tokens_seen": 1})
    asy = manager(tmp_path / "async", async_save=True)
    assert asy.save(1, model, opt, {"tokens_seen": 1}) is None  # in flight
    for s in range(2, 4):  # the optimizer mutates the weights while the write is in flight
        train_step(model, opt, s)
    asy.poll()
    assert asy.wait() in (None, tmp_path / "async" / "step-1")
    assert asy.last_saved == tmp_path / "async" / "step-1"
    a, b = tmp_path / "sync" / "step-1", tmp_path / "async" / "step-1"
    assert digest(a, "model.") == digest(b, "model.")
    assert digest(a, "optim.") == digest(b, "optim.")
    # ...and the digests see the difference: the state after the in-flight steps saves differently.
    later = manager(tmp_path / "later", async_save=False)
    later.save(3, model, opt, {"tokens_seen": 3})
    c = tmp_path / "later" / "step-3"
    assert digest(c, "model.") != digest(b, "model.") and digest(c, "optim.") != digest(b, "optim.")


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["disk", "memory"])
def test_a_background_save_beside_a_cast_forward_saves_the_parameters(tmp_path, kind):
    """Under the bf16 cast a unit holds bf16 copies in place of its parameters while it runs. The save's
    writer thread runs while the first block is held inside its forward: what it saves must be the
    float32 parameters of the step boundary (a state dict read there failed with KeyError at random,
    or would hold the copies)."""
    import threading

    from stalwart.checkpoint.snapshot import SnapshotStore
    from stalwart.parallel.precision import apply_cast

    model, opt = tiny()
    apply_cast(model, torch.bfloat16)
    train_step(model, opt, 1)
    sync = manager(tmp_path / "sync", async_save=False)
    sync.save(1, model, opt, {"tokens_seen": 1})
    if kind == "disk":
        saver = manager(tmp_path / "async", async_save=True)
        saver.save(1, model, opt, {"tokens_seen": 1})
        copied = saver._pending.staging.done
    else:
        saver = SnapshotStore(tmp_path / "snap", 0, 1)
        saver.save_async(1, model, opt, {"tokens_seen": 1})
        copied = saver._inflight[1].done
    inside = []
    block = model.layers["0"]

    def hold(_module, _args):  # runs after the cast swapped this block's parameters for bf16 copies
        inside.append({p.dtype for p in block.parameters()})
        assert copied.wait(30), "the save never copied the state"

    handle = block.register_forward_pre_hook(hold)
    try:
        x = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
        model(x)
    finally:
        handle.remove()
    assert inside == [{torch.bfloat16}]  # the writer really ran while the copies stood in
    if kind == "disk":
        saver.wait()
        assert digest(tmp_path / "sync" / "step-1", "model.") == digest(tmp_path / "async" / "step-1", "model.")
        assert digest(tmp_path / "sync" / "step-1", "optim.") == digest(tmp_path / "async" / "step-1", "optim.")
    else:
        saver.wait()
        fresh, fresh_opt = tiny(seed=5)
        apply_cast(fresh, torch.bfloat16)
        train_step(fresh, fresh_opt, 9)
        saver.load(1, fresh, fresh_opt)
        assert all(torch.equal(a, b) and a.dtype == torch.float32
                   for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert not any(t.name.startswith(("checkpoint-write", "snapshot-")) for t in threading.enumerate()
                   if t.is_alive() and t is not threading.current_thread() and t.daemon is False)


@pytest.mark.unit
def test_manifest_describes_the_run(tmp_path):
    model, opt = tiny()
    m = CheckpointManager(tmp_path, CheckpointConfig(async_save=True), 0, 1, Events(),
                          describe={"layout": {"dp_shard": 1}, "stalwart": "0.1.0", "torch": torch.__version__,
                                    "config_sha256": "ab" * 32})
    m.save(3, model, opt, {"tokens_seen": 0})
    m.wait()
    manifest = json.loads((tmp_path / "step-3" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1 and manifest["config_sha256"] == "ab" * 32
    assert manifest["torch"] == torch.__version__ and manifest["layout"] == {"dp_shard": 1}
    assert {".metadata", "trainer_state.json", "rng-rank0.json", "__0_0.distcp"} <= set(manifest["files"])


# ---------------------------------------------------------------------------- corruption
def _truncate(ckpt: Path) -> str:
    f = next(ckpt.glob("*.distcp"))
    f.write_bytes(f.read_bytes()[:-100])
    return f.name


def _flip(ckpt: Path) -> str:
    f = next(ckpt.glob("*.distcp"))
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x01
    f.write_bytes(bytes(data))
    return f.name


def _delete(ckpt: Path) -> str:
    f = next(ckpt.glob("*.distcp"))
    f.unlink()
    return f.name


def _metadata(ckpt: Path) -> str:
    f = ckpt / ".metadata"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    return ".metadata"


def _manifest_garbage(ckpt: Path) -> str:
    (ckpt / "manifest.json").write_text('{"step": 2, "files": {')
    return "manifest.json"


def _manifest_missing(ckpt: Path) -> str:
    (ckpt / "manifest.json").unlink()
    return "manifest.json"


def _trainer_state(ckpt: Path) -> str:
    f = ckpt / "trainer_state.json"
    f.write_text(f.read_text().replace('"tokens_seen": 2', '"tokens_seen": 9'))
    return "trainer_state.json"


@pytest.mark.unit
@pytest.mark.parametrize("corrupt", [_truncate, _flip, _delete, _metadata, _manifest_garbage, _manifest_missing,
                                     _trainer_state])
def test_corruption_is_refused_by_name_and_resume_falls_back(tmp_path, corrupt):
    m, events = saved_run(tmp_path)
    newest = tmp_path / "step-2"
    bad = corrupt(newest)
    with pytest.raises(CheckpointError) as e:
        m.verify(newest)
    assert str(newest) in str(e.value) and bad in str(e.value)
    model, opt = tiny(seed=5)
    # resume falls back past it: when resolving, or (a shard's checksum) in the load that streams the file
    loaded = m.load_resume(m.resolve_resume(), model, opt)
    assert loaded.step == 1 and loaded.path == tmp_path / "step-1"
    fallback = events.named("checkpoint_fallback")
    assert len(fallback) == 1 and fallback[0]["path"] == str(newest) and bad in fallback[0]["error"]
    fresh, fresh_opt = tiny(seed=5)
    m.load(tmp_path / "step-1", fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


# ---------------------------------------------------------------------------- retention
@pytest.mark.unit
def test_retention_keeps_last_k_and_every_mth(tmp_path):
    events = Events()
    m = manager(tmp_path, events, async_save=True, keep_last=2, keep_every=4)
    model, opt = tiny()
    for s in range(1, 10):
        m.save(s, model, opt, {"tokens_seen": s})
    m.wait()
    assert [p.name for p in m.complete_checkpoints()] == ["step-4", "step-8", "step-9"]
    assert len(events.named("checkpoint_deleted")) == 6
    assert (tmp_path / "latest").read_text().strip() == "step-9"


@pytest.mark.unit
def test_retention_never_deletes_the_only_complete_checkpoint_and_survives_failed_deletes(tmp_path, monkeypatch):
    events = Events()
    m = manager(tmp_path, events, async_save=False, keep_last=1)
    model, opt = tiny()
    m.save(1, model, opt, {"tokens_seen": 1})
    assert [p.name for p in m.complete_checkpoints()] == ["step-1"]

    real_rmtree = shutil.rmtree

    def refuse(path, *a, **k):
        if Path(path).name.startswith("step-"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(mgr.shutil, "rmtree", refuse)
    assert m.save(2, model, opt, {"tokens_seen": 2}) == tmp_path / "step-2"  # deletion failed, save did not
    assert events.named("checkpoint_delete_failed")[0]["path"] == str(tmp_path / "step-1")
    monkeypatch.undo()
    m.save(3, model, opt, {"tokens_seen": 3})
    assert [p.name for p in m.complete_checkpoints()] == ["step-3"]


@pytest.mark.unit
def test_a_killed_saves_partial_directory_is_removed_by_the_next_committed_save(tmp_path):
    events = Events()
    m = manager(tmp_path, events, async_save=False, keep_last=0)
    model, opt = tiny()
    m.save(1, model, opt, {"tokens_seen": 1})
    partial = tmp_path / ".tmp-step-2"  # what a process killed while writing step 2 leaves
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x" * 1000)
    m.save(3, model, opt, {"tokens_seen": 3})
    assert not partial.exists() and [p.name for p in m.complete_checkpoints()] == ["step-1", "step-3"]
    assert [e["path"] for e in events.named("checkpoint_partial_removed")] == [str(partial)]


# ---------------------------------------------------------------------------- failed saves
def _enospc(self, *a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.unit
@pytest.mark.parametrize("async_save", [True, False])
def test_disk_full_fails_loudly_and_training_continues(tmp_path, monkeypatch, capsys, async_save):
    from torch.distributed.checkpoint import FileSystemWriter

    events = Events()
    m = manager(tmp_path, events, async_save=async_save)
    model, opt = tiny()
    m.save(1, model, opt, {"tokens_seen": 1})
    m.wait()
    monkeypatch.setattr(FileSystemWriter, "write_data", _enospc)  # the filesystem-writer boundary
    assert m.save(2, model, opt, {"tokens_seen": 2}) is None
    m.wait()
    failed = events.named("checkpoint_failed")
    assert failed and failed[0]["step"] == 2 and "no space left on the device writing" in failed[0]["error"]
    assert "checkpoint step-2 failed" in capsys.readouterr().err
    assert not (tmp_path / ".tmp-step-2").exists() and not (tmp_path / "step-2").exists()
    assert m.resolve_resume() == tmp_path / "step-1"
    m.load(tmp_path / "step-1", *tiny(seed=3))
    monkeypatch.undo()
    assert m.save(3, model, opt, {"tokens_seen": 3}, block=True) == tmp_path / "step-3"  # recovers


@pytest.mark.unit
def test_on_failure_stop_raises_a_user_error(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    m = manager(tmp_path, async_save=True, on_failure="stop")
    monkeypatch.setattr(FileSystemWriter, "write_data", _enospc)
    model, opt = tiny()
    m.save(1, model, opt, {"tokens_seen": 1})
    with pytest.raises(CheckpointError, match="on_failure = stop"):
        m.wait()


@pytest.mark.e2e  # real tmpfs mounts (root only)
def test_read_only_storage_fails_loudly(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only tmpfs")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        events = Events()
        m = manager(mnt / "ckpt", events, async_save=True)
        model, opt = tiny()
        m.save(1, model, opt, {"tokens_seen": 1})
        m.wait()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        assert m.save(2, model, opt, {"tokens_seen": 2}) is None
        assert events.named("checkpoint_failed") and m.resolve_resume() == mnt / "ckpt" / "step-1"
        assert events.named("checkpoint_failed")[0]["error"].startswith("read-only file system writing ")
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        # A real ENOSPC: fill the 4 MiB tmpfs, then save.
        (mnt / "filler").write_bytes(b"\0" * (4 * 2**20 - (mnt / "ckpt" / "step-1" / "__0_0.distcp").stat().st_size
                                              - 64 * 1024))
        events.clear()
        m.save(3, model, opt, {"tokens_seen": 3})
        m.wait()
        assert events.named("checkpoint_failed") and "no space left on the device writing " in \
            events.named("checkpoint_failed")[0]["error"]
        assert not list((mnt / "ckpt").glob(".tmp-*")) and m.resolve_resume() == mnt / "ckpt" / "step-1"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ---------------------------------------------------------------------------- crashes mid-save
CRASH_SCRIPT = r"""
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from test_checkpoint_unit import manager, tiny, train_step
from stalwart.checkpoint import writer
point, mode, marker = sys.argv[1], sys.argv[2], sys.argv[3]
armed = []
def hook(name):
    if name == point and armed:
        if mode == "exit":
            os._exit(137)
        open(marker, "w").close()
        time.sleep(60)
writer.fault_point = hook
m = manager(__import__("pathlib").Path(sys.argv[4]), async_save=mode != "exit", keep_last=0)
model, opt = tiny()
train_step(model, opt, 1)
m.save(1, model, opt, {{"tokens_seen": 1}}, block=True)
train_step(model, opt, 2)
armed.append(1)
m.save(2, model, opt, {{"tokens_seen": 2}})
train_step(model, opt, 3)
m.wait()
"""


def _crash_run(tmp_path, point, mode):
    script = CRASH_SCRIPT.format(tests=str(Path(__file__).parent))
    marker = tmp_path / "marker"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, "-c", script, point, mode, str(marker), str(tmp_path / "ck")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE), marker


@pytest.mark.multiproc
@pytest.mark.parametrize("point", ["before_write", "after_shards", "after_metadata", "before_rename"])
def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, point):
    proc, _ = _crash_run(tmp_path, point, "exit")
    proc.wait(timeout=120)
    assert proc.returncode == 137, proc.stderr.read().decode()[-2000:]
    root = tmp_path / "ck"
    assert (root / ".tmp-step-2").is_dir() and not (root / "step-2").exists()
    m = manager(root)
    assert m.resolve_resume() == root / "step-1"
    assert m.load(root / "step-1", *tiny(seed=7)).step == 1


@pytest.mark.multiproc
def test_sigkill_during_async_write_keeps_the_previous_checkpoint(tmp_path):
    import signal
    import time

    proc, marker = _crash_run(tmp_path, "after_shards", "sleep")
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # the real process, mid-write of step 2
    proc.wait(timeout=30)
    root = tmp_path / "ck"
    assert not (root / "step-2").exists()
    m = manager(root)
    assert m.resolve_resume() == root / "step-1"
    # The next save of that step replaces the partial directory.
    model, opt = tiny()
    assert manager(root, async_save=False).save(2, model, opt, {"tokens_seen": 2}) == root / "step-2"
    assert not (root / ".tmp-step-2").exists()


@pytest.mark.unit
def test_append_writers_name_a_full_device_in_words(tmp_path):
    from stalwart.errors import StorageError, UserError
    from stalwart.metrics.records import EventLog

    full = tmp_path / "events.jsonl"
    full.symlink_to("/dev/full")  # every write: ENOSPC
    log = EventLog(full)
    with pytest.raises(StorageError, match=f"no space left on the device writing {full}") as e:
        log("start")
    assert isinstance(e.value, UserError) and isinstance(e.value, OSError)  # exit 2; tolerated where OSError is
    log.close()
