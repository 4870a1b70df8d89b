"""Sharded, atomic, verified checkpoints of the whole training state.

A checkpoint is written under ``checkpoints/.tmp-step-N``; every rank writes its DCP shard, its RNG
state and a manifest of SHA-256 checksums of the files it wrote; after a barrier rank 0 merges the
manifests into ``manifest.json``, fsyncs, renames the directory to ``step-N`` and updates ``latest``.
A directory named ``step-N`` is therefore always complete, and a crash mid-save leaves only a
``.tmp-*`` directory that is never loaded. Loading verifies every checksum first.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from stalwart.errors import UserError
from stalwart.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpointError

STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used; the message names the checkpoint and the bad file."""


@dataclass
class LoadedState:
    path: Path
    step: int
    trainer_state: dict[str, Any]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    _fsync_file(tmp)
    os.replace(tmp, path)


def rng_state() -> dict[str, str]:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, str]) -> None:
    import numpy as np

    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["cpu"]), dtype=np.uint8).copy()))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.from_numpy(
            np.frombuffer(base64.b64decode(state["cuda"]), dtype=np.uint8).copy()))


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes' single-process mode even when asked for it explicitly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    """Save, find, verify and load checkpoints of one run. ``cfg`` is the ``checkpoint`` section."""

    def __init__(self, root: Path, cfg, rank: int, world_size: int, log_event: Callable[..., None],
                 describe: dict[str, Any] | None = None) -> None:
        self.root, self.cfg = Path(root), cfg
        self.rank, self.world_size = rank, world_size
        self.log_event = log_event
        self.describe = describe or {}

    # ------------------------------------------------------------------ save
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any]) -> Path:
        t0 = time.perf_counter()
        tmp = self.root / f".tmp-step-{step}"
        final = self.root / f"step-{step}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _quiet_single_process():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                     no_dist=not (dist.is_available() and dist.is_initialized()))
        rng_file = tmp / f"rng-rank{self.rank}.json"
        _write_json_atomic(rng_file, rng_state())
        if self.rank == 0:
            _write_json_atomic(tmp / TRAINER_STATE, {"step": step, **trainer_state})
        # Each rank checksums what it wrote; rank 0 also owns the shared metadata files.
        mine = sorted(tmp.glob(f"__{self.rank}_*.distcp")) + [rng_file]
        if self.rank == 0:
            mine += [tmp / ".metadata", tmp / TRAINER_STATE]
        entries = {}
        for f in mine:
            _fsync_file(f)
            entries[f.name] = {"sha256": _sha256(f), "bytes": f.stat().st_size}
        _write_json_atomic(tmp / f"manifest-rank{self.rank}.json", entries)
        _barrier()
        if self.rank == 0:
            files: dict[str, Any] = {}
            for r in range(self.world_size):
                part = tmp / f"manifest-rank{r}.json"
                files.update(json.loads(part.read_text()))
                part.unlink()
            manifest = {"step": step, "files": files, "world_size": self.world_size,
                        "created": time.time(), **self.describe}
            _write_json_atomic(tmp / MANIFEST, manifest)
            _fsync_dir(tmp)
            if final.exists():  # a stale checkpoint of the same step from an abandoned trajectory
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            (self.root / "latest.tmp").write_text(final.name + "\n")
            os.replace(self.root / "latest.tmp", self.root / "latest")
            _fsync_dir(self.root)
            self.log_event("checkpoint_saved", step=step, path=str(final), seconds=time.perf_counter() - t0)
            self._apply_retention(keep=final)
        _barrier()
        return final

    def _apply_retention(self, keep: Path) -> None:
        if not self.cfg.keep_last:
            return
        complete = self.complete_checkpoints()
        for path in complete[:-self.cfg.keep_last]:
            if path == keep:
                continue
            try:
                shutil.rmtree(path)
                self.log_event("checkpoint_deleted", path=str(path))
            except OSError as e:  # a failed deletion must never stop training
                self.log_event("checkpoint_delete_failed", path=str(path), error=str(e))

    # ------------------------------------------------------------------ find
    def complete_checkpoints(self) -> list[Path]:
        """``step-N`` directories, oldest first (``.tmp-*`` ones are partial and ignored)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found)]

    def verify(self, path: Path) -> dict[str, Any]:
        """Check the manifest and every file's size and checksum; raise CheckpointError naming the bad file."""
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} is missing (incomplete or not a checkpoint)")
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt ({e})") from None
        for name, meta in sorted(files.items()):
            f = path / name
            if not f.is_file():
                raise CheckpointError(f"checkpoint {path}: file {name} is missing")
            if f.stat().st_size != meta["bytes"]:
                raise CheckpointError(f"checkpoint {path}: file {name} has {f.stat().st_size} bytes, "
                                      f"expected {meta['bytes']} (truncated?)")
            if _sha256(f) != meta["sha256"]:
                raise CheckpointError(f"checkpoint {path}: file {name} fails its checksum (corrupted)")
        return manifest

    def resolve_resume(self) -> Path | None:
        """The checkpoint to resume from under ``checkpoint.resume``, falling back past bad ones."""
        mode = self.cfg.resume
        if mode == "none":
            return None
        if mode != "auto":
            path = Path(mode)
            if not path.is_dir():
                raise CheckpointError(f"checkpoint.resume: '{mode}' is not a checkpoint directory")
            self.verify(path)
            return path
        for path in reversed(self.complete_checkpoints()):
            try:
                self.verify(path)
                return path
            except CheckpointError as e:
                self.log_event("checkpoint_fallback", path=str(path), error=str(e))
                if self.rank == 0:
                    print(f"warning: {e}; falling back to an older checkpoint", flush=True)
        return None

    # ------------------------------------------------------------------ load
    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> LoadedState:
        self.verify(path)
        trainer_state = json.loads((path / TRAINER_STATE).read_text())
        no_dist = not (dist.is_available() and dist.is_initialized())
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_state_dict(model, [], options=StateDictOptions())[0]}
        try:
            with _quiet_single_process():
                dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
                         no_dist=no_dist)
        except UnsafeCheckpointError as e:
            raise CheckpointError(f"checkpoint {path}: refused: {e}") from None
        except Exception as e:  # DCP wraps per-rank failures in its own exception types
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {path}: cannot be loaded into this model: {msg}") from None
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
        rng_file = path / f"rng-rank{self.rank}.json"
        if rng_file.is_file():
            set_rng_state(json.loads(rng_file.read_text()))
        return LoadedState(path=path, step=int(trainer_state["step"]), trainer_state=trainer_state)
