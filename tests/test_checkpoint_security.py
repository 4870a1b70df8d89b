"""Checkpoints crafted to run code on load are refused on every load path, and the code never runs.

The attacker is assumed to control the whole checkpoint directory, so each crafted file's checksum
is re-written into manifest.json (checksums alone do not stop this attack; the safe loaders must).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY_RUN, run_cli
from stalwart.checkpoint.direct_io import HASH, file_digest
from stalwart.checkpoint.manager import CheckpointManager
from stalwart.checkpoint.safe_io import read_dcp_metadata
from stalwart.checkpoint.blob import SnapshotError, deserialize
from stalwart.checkpoint.snapshot import SnapshotStore
from stalwart.paths import RunPaths
from stalwart.config.job import CheckpointConfig
from stalwart.errors import UserError
from test_checkpoint_unit import saved_run, tiny

class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sec") / "run"
    run_cli("train", "--run.dir", str(run), *TINY_RUN, "--training.steps", "2", "--sample.max_new_tokens", "0")
    return run


def _rehash(ckpt: Path) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in manifest["files"]:
        f = ckpt / name
        manifest["files"][name] = {HASH: file_digest(f), "bytes": f.stat().st_size}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _evil_metadata(ckpt: Path, marker: Path) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil(marker)))


def _evil_entry(ckpt: Path, marker: Path, tensor: bool) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    with (ckpt / ".metadata").open("rb") as fh:
        metadata = read_dcp_metadata(fh)
    kind = TensorStorageMetadata if tensor else BytesStorageMetadata
    index = next(i for i in metadata.storage_data if isinstance(metadata.state_dict_metadata[i.fqn], kind))
    info = metadata.storage_data[index]
    payload = io.BytesIO()
    torch.save(Evil(marker), payload)
    shard = ckpt / info.relative_path
    offset = shard.stat().st_size
    with shard.open("ab") as fh:
        fh.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    with (ckpt / ".metadata").open("wb") as fh:
        pickle.dump(metadata, fh)


def _evil_trainer_state(ckpt: Path, marker: Path) -> None:
    (ckpt / "trainer_state.json").write_bytes(pickle.dumps(Evil(marker)))


def _evil_rng(ckpt: Path, marker: Path) -> None:
    (ckpt / "rng-rank0.json").write_bytes(pickle.dumps(Evil(marker)))


CRAFTS = {
    "metadata": _evil_metadata,
    "distcp_bytes_entry": lambda c, m: _evil_entry(c, m, tensor=False),
    "distcp_tensor_entry": lambda c, m: _evil_entry(c, m, tensor=True),
    "trainer_state": _evil_trainer_state,
    "rng": _evil_rng,
}


def _load_for_resume(run: Path) -> None:
    """What Trainer._resume does: the manager loads model *and* optimizer."""
    from stalwart.config import load
    from stalwart.config.job import JobConfig
    from stalwart.data.tokenizer import load_tokenizer
    from stalwart.models.flavors import resolve_args
    from stalwart.models.llama import Transformer
    from stalwart.train.optim import build_optimizer

    cfg = load(JobConfig, run / "config.toml")
    args = resolve_args(cfg.model, load_tokenizer(run / "tokenizer.json").get_vocab_size(), cfg.data.seq_len)
    model = Transformer(args)
    m = CheckpointManager(run / "checkpoints", CheckpointConfig(), 0, 1, lambda *a, **k: None)
    m.load(run / "checkpoints" / "step-2", model, build_optimizer(cfg.optimizer, model))


def _generate(run: Path) -> None:
    from stalwart.cli.generate import load_run_model

    load_run_model(run)


def _export(run: Path) -> None:
    from stalwart.cli.export import export_run

    export_run(run, run.parent / "hf-out")


@pytest.mark.e2e
@pytest.mark.parametrize("craft", list(CRAFTS))
def test_malicious_checkpoint_is_refused_everywhere(good_run, tmp_path, craft):
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    marker = tmp_path / "PWNED"
    ckpt = run / "checkpoints" / "step-2"
    CRAFTS[craft](ckpt, marker)
    _rehash(ckpt)
    # Which load paths read the crafted file (the others must simply not run it either).
    reads = {"metadata": {"resume", "generate", "export"}, "distcp_bytes_entry": {"resume"},
             "distcp_tensor_entry": {"resume", "generate", "export"}, "trainer_state": {"resume", "generate"},
             "rng": {"resume", "generate"}}[craft]
    for name, load_path in (("resume", _load_for_resume), ("generate", _generate), ("export", _export)):
        try:
            load_path(run)
            refused = None
        except UserError as e:
            refused = str(e)
        assert not marker.exists(), f"{craft} executed code via {name}"
        if name in reads:
            assert refused and "step-2" in refused, (name, refused)


@pytest.mark.e2e
def test_malicious_checkpoint_through_the_cli(good_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    marker = tmp_path / "PWNED"
    _evil_metadata(run / "checkpoints" / "step-2", marker)
    _rehash(run / "checkpoints" / "step-2")
    entry = tmp_path / "entry"  # a crafted tensor entry: torch's own refusal advises turning the safety off
    shutil.copytree(good_run, entry)
    _evil_entry(entry / "checkpoints" / "step-2", marker, tensor=True)
    _rehash(entry / "checkpoints" / "step-2")
    for args in (["generate", "--run", str(run), "--max-new-tokens", "2"],
                 ["generate", "--run", str(entry), "--max-new-tokens", "2"],
                 ["export", "--run", str(run), "--out", str(tmp_path / "hf")],
                 ["train", "--run.dir", str(run), *TINY_RUN, "--training.steps", "4"]):
        proc = run_cli(*args, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "refused" in lines[0] and "step-2" in lines[0], proc.stderr[-2000:]
        assert "{" not in lines[0] and ") from None" not in lines[0], lines[0]  # never a line of source code
        if args[0] == "generate" and str(entry) in args:  # the crafted entry is named, with what it held
            assert "checkpoint entry 'model." in lines[0] and "posix.system" in lines[0], lines[0]
        assert "weights_only" not in proc.stdout + proc.stderr
        assert not marker.exists()


@pytest.mark.unit
def test_checkpoint_refused_at_load_falls_back_like_a_corrupt_one(tmp_path):
    m, events = saved_run(tmp_path)
    _evil_metadata(tmp_path / "step-2", tmp_path / "PWNED")
    _rehash(tmp_path / "step-2")  # passes its checksums
    path = m.resolve_resume()
    assert path == tmp_path / "step-2"
    assert m.load_resume(path, *tiny(seed=5)).step == 1
    fallback = events.named("checkpoint_fallback")
    assert [f["path"] for f in fallback] == [str(path)] and "refused" in fallback[0]["error"]
    _evil_metadata(tmp_path / "step-1", tmp_path / "PWNED")
    _rehash(tmp_path / "step-1")
    with pytest.raises(UserError, match="step-1: refused"):  # nothing good left: the refusal stands
        m.load_resume(path, *tiny(seed=5))
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.e2e
def test_a_refused_checkpoint_falls_back_and_a_rank_error_is_blamed_on_that_rank(tmp_path):
    """Two processes: the newest checkpoint is refused at load (a crafted entry that passes its
    checksums) and the run falls back; the older one is unusable on rank 1 alone. The job ends with
    exit 2 and that rank's one line: no tracebacks, no goodput report, no restart."""
    run = tmp_path / "run"
    two = ["--run.dir", str(run), *TINY_RUN, "--nproc-per-node", "2", "--checkpoint.interval", "2",
           "--sample.max_new_tokens", "0"]
    run_cli("train", *two, "--training.steps", "4")
    ck = run / "checkpoints"
    _evil_entry(ck / "step-4", tmp_path / "PWNED", tensor=True)
    (ck / "step-2" / "rng-rank1.json").write_text("{not json")
    for s in (2, 4):
        _rehash(ck / f"step-{s}")
    proc = run_cli("train", *two, "--training.steps", "6", "--launch.max_restarts", "3", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"stalwart train: error (rank 1): checkpoint {ck / 'step-2'}: file rng-rank1.json is malformed "
        "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"]
    assert "Traceback" not in proc.stdout and "weights_only" not in proc.stdout and "ETTR" not in proc.stdout
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    fallback = [e for e in events if e["event"] == "checkpoint_fallback"]
    assert [e["path"] for e in fallback] == [str(ck / "step-4")] and "refused" in fallback[0]["error"]
    failures = [e for e in events if e["event"] == "failure"]
    assert [(f["rank"], f["kind"], f["decision"]) for f in failures] == [(1, "user_error", "user_error")]
    assert events[-1]["event"] == "supervisor_exit" and events[-1]["code"] == 2
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.unit
def test_malicious_snapshot_is_refused(tmp_path):
    marker = tmp_path / "PWNED"
    job = tmp_path / "job"
    own = job / "rank-0" / "own"
    own.mkdir(parents=True)
    (own / "step-5.snap").write_bytes(pickle.dumps(Evil(marker)))
    store = SnapshotStore(job, 0, 1)
    assert store.newest_complete_step() is None
    with pytest.raises(SnapshotError):
        store.load(5, *tiny())
    with pytest.raises(SnapshotError):
        deserialize((own / "step-5.snap").read_bytes())
    assert not marker.exists()
    assert RunPaths(tmp_path).snapshots().parent == Path("/dev/shm")
