"""Writing one DCP checkpoint in two stages: plan + stage on the main thread, write in the background.

``dcp.save`` interleaves collectives (plan gather/scatter, result gather) with file I/O. Running it in
a background thread would issue gloo collectives concurrently with the training loop's, which can
deadlock or mismatch. So Stalwart splits it:

1. ``stage_state``: copy the state dict into host buffers (reused across saves). After this the
   optimizer may mutate the weights freely.
2. ``plan_save`` (main thread, collectives): DCP's local plans are gathered, rank 0 builds the global
   plan and metadata, each rank gets its final plan back.
3. ``write_local`` (background thread or inline): pure local file I/O: this rank's ``.distcp`` shard,
   RNG state, rank 0's trainer state, fsync, and a per-rank manifest of SHA-256 checksums.
4. The commit (``CheckpointManager``, main thread): results are gathered, rank 0 writes ``.metadata``
   and the merged manifest and renames the directory.

Sync and async saves run exactly this code; only *where* step 3 runs differs, so they produce the
same bytes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata

from stalwart.atomic import write_json_atomic

TRAINER_STATE = "trainer_state.json"


def fault_point(name: str) -> None:
    """No-op hook at each stage of a save; crash tests replace it (``manager.fault_point``)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (main thread only). One process: ``[obj]``."""
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------- staging
class HostStager:
    """Copies a state dict into host (pinned on CUDA) buffers, reused while the structure is unchanged.

    Memory cost: one extra copy of this rank's model + optimizer shard, held for the whole run.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self._signature: Any = None

    @staticmethod
    def _sig(state: dict[str, Any]) -> Any:
        def walk(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return (tuple(x.shape), x.dtype)
            if isinstance(x, dict):
                return tuple((k, walk(v)) for k, v in x.items())
            if isinstance(x, (list, tuple)):
                return tuple(walk(v) for v in x if isinstance(v, (torch.Tensor, dict, list, tuple)))
            return None
        return walk(state)

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        sig = self._sig(state)
        if self._buffers is None or sig != self._signature:
            pin = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._buffers = _create_cpu_state_dict(state, pin_memory=pin)
            self._signature = sig
        # Tensors land in our buffers; plain values (lr, betas, ...) are the fresh ones from `state`.
        staged = _copy_state_dict(state, self._buffers, non_blocking=False)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return staged


# ---------------------------------------------------------------------- plan + write
@dataclass
class SaveJob:
    """One rank's part of one checkpoint save, between planning and commit."""

    step: int
    tmp: Path
    rank: int
    writer: FileSystemWriter
    planner: DefaultSavePlanner
    plan: Any
    metadata: Metadata | None  # rank 0 only
    rng: dict[str, str]
    trainer_state: dict[str, Any] | None  # rank 0 only
    files: dict[str, Any] = field(default_factory=dict)


def plan_save(step: int, tmp: Path, rank: int, state: dict[str, Any], rng: dict[str, str],
              trainer_state: dict[str, Any] | None) -> SaveJob:
    """DCP planning with all collectives on the calling (main) thread."""
    writer = FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True, thread_count=1)
    planner = DefaultSavePlanner()
    coordinator = rank == 0
    planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
    writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    plans = all_gather_object(local_plan)
    metadata = None
    central = [None]
    if coordinator:
        global_plans, metadata = planner.create_global_plan(plans)
        central = [writer.prepare_global_plan(global_plans)]
    if distributed():
        dist.broadcast_object_list(central, src=0)
    final_plan = planner.finish_plan(central[0][rank])
    return SaveJob(step, tmp, rank, writer, planner, final_plan, metadata, rng, trainer_state)


def write_local(job: SaveJob) -> list[Any]:
    """This rank's files (no collectives: safe on a background thread). Returns DCP's write results."""
    fault_point("before_write")
    results = job.writer.write_data(job.plan, job.planner).value()
    fault_point("after_shards")
    written = [job.tmp / f"rng-rank{job.rank}.json"]
    write_json_atomic(written[0], job.rng)
    if job.trainer_state is not None:
        write_json_atomic(job.tmp / TRAINER_STATE, job.trainer_state)
        written.append(job.tmp / TRAINER_STATE)
    mine = sorted(job.tmp.glob(f"__{job.rank}_*.distcp")) + written
    entries = {}
    for f in mine:
        fsync_file(f)
        entries[f.name] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    write_json_atomic(job.tmp / f"manifest-rank{job.rank}.json", entries)
    fault_point("after_rank_manifest")
    return results
