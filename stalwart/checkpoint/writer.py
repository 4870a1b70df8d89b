"""Writing one DCP checkpoint in two stages: plan + stage on the main thread, write in the background.

``dcp.save`` interleaves collectives (plan gather/scatter, result gather) with file I/O. Running it in
a background thread would issue gloo collectives concurrently with the training loop's, which can
deadlock or mismatch. So Stalwart splits it:

1. ``stage_state``: copy the state dict into host buffers (reused across saves). After this the
   optimizer may mutate the weights freely.
2. ``plan_save`` (main thread, collectives): DCP's local plans are gathered, rank 0 builds the global
   plan and metadata, each rank gets its final plan back.
3. ``write_local`` (background thread or inline): pure local file I/O: this rank's ``.distcp`` shard,
   RNG state, rank 0's trainer state, fsync, and a per-rank manifest of checksums (XXH3-128, see
   ``direct_io``).
4. The commit (``CheckpointManager``, main thread): results are gathered, rank 0 writes ``.metadata``
   and the merged manifest and renames the directory.

Sync and async saves run exactly this code; only *where* step 3 runs differs, so they produce the
same bytes.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from stalwart.atomic import write_json_atomic
from stalwart.checkpoint.direct_io import HASH, HashingWriteStream, file_digest

TRAINER_STATE = "trainer_state.json"


def fault_point(name: str) -> None:
    """No-op hook at each stage of a save; crash tests replace it (``manager.fault_point``)."""


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


# ---------------------------------------------------------------------- plan + write
WRITERS = 2  # shard files (and writer threads) per rank for a large shard: serializing one keeps a core busy
PARALLEL_FROM = 64 << 20  # below this many bytes one file per rank is as fast and keeps the layout simple


def _writers(plan: Any) -> int:
    from torch.distributed.checkpoint.filesystem import _item_size
    from torch.distributed.checkpoint.planner import WriteItemType

    total = sum(_item_size(i) for i in plan.items if i.type != WriteItemType.BYTE_IO)
    return WRITERS if total >= PARALLEL_FROM else 1


class HashingFileSystem(FileSystem):
    """DCP's local filesystem, with shard files written by :class:`HashingWriteStream` (direct I/O,
    checksummed while writing); their digests land in ``digests`` so nothing is re-read to checksum it."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def _record(self, name: str, digest: str, size: int) -> None:
        with self._lock:
            self.digests[name] = {HASH: digest, "bytes": size}

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb" or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = HashingWriteStream(Path(path), on_close=self._record)
        try:
            yield stream
        except BaseException:
            stream.abort()
            raise
        stream.close()


class HashingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose shard streams hash while writing and fsync on close."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, sync_files=False, **kwargs)  # each stream fsyncs itself on close
        self.fs = HashingFileSystem()


@dataclass
class SaveJob:
    """One rank's part of one checkpoint save, between planning and commit."""

    step: int
    tmp: Path
    rank: int
    writer: HashingFileSystemWriter
    planner: DefaultSavePlanner
    plan: Any
    metadata: Metadata | None  # rank 0 only
    rng: dict[str, str]
    trainer_state: dict[str, Any] | None  # rank 0 only
    files: dict[str, Any] = field(default_factory=dict)


def plan_save(step: int, tmp: Path, rank: int, state: dict[str, Any], rng: dict[str, str],
              trainer_state: dict[str, Any] | None) -> SaveJob:
    """DCP planning with all collectives on the calling (main) thread. Needs only the state's
    structure: the tensors' bytes may still be on their way into ``state`` (async staging)."""
    writer = HashingFileSystemWriter(str(tmp), single_file_per_rank=True)
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
    writer.thread_count = _writers(final_plan)
    return SaveJob(step, tmp, rank, writer, planner, final_plan, metadata, rng, trainer_state)


@contextmanager
def _no_zip_crc():
    """DCP stores each tensor as a torch.save zip record, whose CRC-32 costs several times the CPU of
    the checksum we compute anyway; the manifest's digest protects the same bytes, so skip the CRC (torch
    loads records without one). NOTE: the switch is process-wide while a shard is being written."""
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def write_local(job: SaveJob) -> list[Any]:
    """This rank's files (no collectives: safe on a background thread). Returns DCP's write results."""
    fault_point("before_write")
    with _no_zip_crc():
        results = job.writer.write_data(job.plan, job.planner).value()
    fault_point("after_shards")
    written = [job.tmp / f"rng-rank{job.rank}.json"]
    write_json_atomic(written[0], job.rng)
    if job.trainer_state is not None:
        write_json_atomic(job.tmp / TRAINER_STATE, job.trainer_state)
        written.append(job.tmp / TRAINER_STATE)
    digests = job.writer.fs.digests
    entries = {}
    for f in sorted(job.tmp.glob(f"__{job.rank}_*.distcp")) + written:
        if f.name in digests:  # hashed while written, durable on close
            entries[f.name] = digests[f.name]
        else:  # small JSON files, already fsynced by the atomic write
            entries[f.name] = {HASH: file_digest(f), "bytes": f.stat().st_size}
    write_json_atomic(job.tmp / f"manifest-rank{job.rank}.json", entries)
    fault_point("after_rank_manifest")
    return results
