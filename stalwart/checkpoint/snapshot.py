"""In-memory snapshots for checkpoint-free recovery: each rank's shard in tmpfs, plus a copy on a peer.

Every ``checkpoint.memory_interval`` steps each rank serializes its *local* shard of the model and
optimizer state, the trainer state and its RNG into one blob and keeps it in RAM that outlives the
process: a file under a per-job directory in ``/dev/shm`` (the elastic agent restarts the whole worker
group, so the process heap is gone). The blob is also sent (``torch.distributed`` send/recv) to a
peer rank, which stores it in its own ``/dev/shm``: the rank with the same local rank on the next host,
or the next rank on a single host. A replaced host's shard is thus still held by its peer.

On restart, ``newest_complete_step()`` (collective) finds the newest step whose every rank's shard is
available (own copy, else the peer's), and ``load()`` (collective) restores it; a missing own copy is
sent back by the peer. Snapshots restore only into the same world layout (they hold local shards);
otherwise recovery falls back to the disk checkpoint, which DCP can reshard.

A snapshot is taken off the loop like an async checkpoint: the loop only starts it; a background
thread copies the shard into the blob while the next forward/backward runs (the optimizer's next
step waits for that copy), then hashes, stores and exchanges it over a process group of its own.

Memory: ``2 x`` this rank's local shard state (model + optimizer + a little JSON) per rank in tmpfs
(own + peer copy), bounded: only the newest snapshot of each is kept (``memory_bytes``).

The blob (no pickle; ``blob.py``) is a checksummed JSON header of the state's structure followed by the
raw tensor bytes. Loading parses JSON and copies raw bytes.

Fault-tolerance API (all methods except ``clear`` are collective over the default process group)::

    store = SnapshotStore(job_dir, rank, world_size, local_world_size, layout="dp_shard=2")
    store.save(step, model, optimizer, trainer_state)   # trainer_state: JSON-able dict; returns when stored
    store.save_async(step, model, optimizer, trainer_state)  # returns at once; store.wait() finishes it
    step = store.newest_complete_step()                 # int | None
    trainer_state = store.load(step, model, optimizer)  # restores weights, optimizer, RNG; returns dict
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from stalwart.atomic import write_bytes_atomic
from stalwart.checkpoint.blob import BlobLayout, SnapshotError, deserialize, restore_into
from stalwart.checkpoint.loader import rng_state, set_rng_state
from stalwart.checkpoint.staging import StepHold
from stalwart.checkpoint.writer import all_gather_object
from stalwart.paths import snapshot_name, snapshot_step
from stalwart.runtime.group import cpu_group


class SnapshotStore:
    """Newest in-memory snapshot of this rank's shard, plus the peer copy of another rank's."""

    def __init__(self, job_dir: str | Path, rank: int, world_size: int, local_world_size: int | None = None,
                 layout: str = "") -> None:
        self.job_dir = Path(job_dir)
        self.rank, self.world = rank, world_size
        self.local_world = local_world_size or world_size
        self.layout = layout
        self.own_dir = self.job_dir / f"rank-{rank}" / "own"
        self.peer_dir = self.job_dir / f"rank-{rank}" / "peer"
        self.peer = self.peer_of(rank)
        self.source = next((r for r in range(world_size) if self.peer_of(r) == rank and r != rank), None)
        self._verified: set[tuple] = set()
        self._inflight: tuple | None = None  # (thread, StepHold, result) of a snapshot being stored
        self._group = None
        self.last_stall_s = 0.0  # how long the newest snapshot held the loop

    def peer_of(self, rank: int) -> int | None:
        """Same local rank on the next host (multi-node), else the next rank on this host."""
        if self.world <= 1:
            return None
        step = self.local_world if self.world > self.local_world else 1
        return (rank + step) % self.world

    # -------------------------------------------------------------- files
    @staticmethod
    def _files(d: Path) -> dict[int, Path]:
        out = {}
        if d.is_dir():
            for p in d.glob("step-*.snap"):
                if (s := snapshot_step(p)) is not None:
                    out[s] = p
        return out

    @staticmethod
    def common_steps(job_dir: Path) -> set[int]:
        """Steps whose snapshot file every rank directory holds (own or peer copy); files only, no
        checksums, no collectives: what a supervisor can see from outside the workers."""
        per_rank = [set(SnapshotStore._files(d / "own")) | set(SnapshotStore._files(d / "peer"))
                    for d in job_dir.glob("rank-*")] if job_dir.is_dir() else []
        return set.intersection(*per_rank) if per_rank else set()

    @staticmethod
    def _write(d: Path, step: int, blob: bytes | bytearray) -> None:
        d.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(d / snapshot_name(step), blob, durable=False)  # tmpfs: nothing to sync to
        for s, p in SnapshotStore._files(d).items():  # bounded: only the newest one is kept
            if s != step:
                p.unlink(missing_ok=True)

    @staticmethod
    def _read(path: Path) -> bytearray:
        buf = bytearray(path.stat().st_size)
        with path.open("rb") as fh:
            fh.readinto(buf)
        return buf

    def _valid(self, path: Path, what: str) -> bool:
        """Checksum-verified once per file version (a rewrite changes size/mtime/inode)."""
        try:
            st = path.stat()
            key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
            if key in self._verified:
                return True
            deserialize(self._read(path), what)
            self._verified.add(key)
            return True
        except (OSError, SnapshotError):
            return False

    @property
    def memory_bytes(self) -> int:
        """Bytes this rank holds in tmpfs now (own + peer copy)."""
        self.wait()
        return sum(p.stat().st_size for d in (self.own_dir, self.peer_dir) for p in self._files(d).values())

    # -------------------------------------------------------------- save
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any]) -> int:
        """Snapshot this rank's shard and wait until it is stored (collective: peer exchange).
        Returns the blob size in bytes."""
        self.save_async(step, model, optimizer, trainer_state)
        return self.wait()

    def save_async(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   trainer_state: dict[str, Any]) -> None:
        """Start a snapshot (collective) and return at once: the shard is copied into the blob on a
        background thread while the loop computes (the optimizer's next step waits for the copy),
        then hashed, stored and exchanged with the peer there. ``wait`` finishes it; every other
        method waits for it first."""
        self.wait()
        t0 = time.perf_counter()
        meta = {"step": step, "rank": self.rank, "world": self.world, "layout": self.layout}
        extra = {"trainer": {"step": step, **trainer_state}, "rng": rng_state()}
        group = self._exchange_group()
        # Read at the step boundary (collective under FSDP), never beside the next forward: a unit under
        # the mixed-precision cast holds bf16 copies in place of its parameters while it runs.
        model_sd, optim_sd = get_state_dict(model, optimizer)
        hold = StepHold(optimizer)
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                try:
                    blob = BlobLayout({"meta": meta, "model": model_sd, "optim": optim_sd, **extra}).fill()
                finally:
                    hold.done.set()
                result["size"] = self._store(step, BlobLayout.seal(blob), group)
            except BaseException as e:  # noqa: BLE001 - raised by wait(), on the caller's thread
                result["error"] = e

        thread = threading.Thread(target=run, name=f"snapshot-{step}", daemon=True)
        thread.start()
        self._inflight = (thread, hold, result)
        self.last_stall_s = time.perf_counter() - t0

    def wait(self) -> int | None:
        """Finish the in-flight snapshot, if any: its blob size, or its error raised here."""
        if self._inflight is None:
            return None
        thread, hold, result = self._inflight
        self._inflight = None
        self.last_stall_s += hold.close()
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["size"]

    def _store(self, step: int, blob: bytearray, group) -> int:
        self._write(self.own_dir, step, blob)
        if self.world > 1:
            got = self._exchange(blob if self.peer is not None else None, send_to=self.peer, recv_from=self.source,
                                 group=group)
            if got is not None:
                self._write(self.peer_dir, step, got)
        return len(blob)

    def _exchange_group(self):
        """A process group of its own for the background peer exchange (created on the first save,
        which every rank makes at the same step): the loop's collectives never interleave with it."""
        if self.world > 1 and self._group is None:
            self._group = cpu_group()
        return self._group

    def _exchange(self, blob: bytes | None, send_to: int | None, recv_from: int | None,
                  recv_size: int | None = None, group=None) -> bytes | None:
        """Send ``blob`` to ``send_to`` and receive from ``recv_from`` (sizes first unless given)."""
        ops = []
        if recv_size is None:
            size_out = torch.tensor([len(blob) if blob is not None else 0], dtype=torch.int64)
            size_in = torch.zeros(1, dtype=torch.int64)
            if send_to is not None:
                ops.append(dist.P2POp(dist.isend, size_out, send_to, group))
            if recv_from is not None:
                ops.append(dist.P2POp(dist.irecv, size_in, recv_from, group))
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait()
            recv_size = int(size_in.item())
            ops = []
        data_in = torch.empty(recv_size, dtype=torch.uint8) if recv_from is not None else None
        if send_to is not None:
            buf = blob if isinstance(blob, bytearray) else bytearray(blob)
            ops.append(dist.P2POp(dist.isend, torch.frombuffer(buf, dtype=torch.uint8), send_to, group))
        if recv_from is not None:
            ops.append(dist.P2POp(dist.irecv, data_in, recv_from, group))
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        return bytearray(data_in.numpy().data) if data_in is not None else None

    # -------------------------------------------------------------- recovery
    def _report(self) -> dict[str, Any]:
        own = {s: p.stat().st_size for s, p in self._files(self.own_dir).items()
               if self._valid(p, f"snapshot {p}")}
        peer = {s: p.stat().st_size for s, p in self._files(self.peer_dir).items()
                if self._valid(p, f"snapshot {p}")}
        return {"rank": self.rank, "world": self.world, "layout": self.layout, "own": own, "peer": peer}

    def _plan(self, reports: list[dict[str, Any]], step: int) -> dict[int, int] | None:
        """rank -> who provides its shard at ``step`` (itself or its peer), or None if incomplete."""
        if any(r["world"] != self.world or r["layout"] != self.layout for r in reports):
            return None
        plan = {}
        for r in range(self.world):
            if step in reports[r]["own"]:
                plan[r] = r
            elif (p := self.peer_of(r)) is not None and step in reports[p]["peer"]:
                plan[r] = p
            else:
                return None
        return plan

    def newest_complete_step(self) -> int | None:
        """Newest step whose every rank's shard is available somewhere (collective)."""
        self.wait()
        reports = all_gather_object(self._report())
        steps = sorted({s for r in reports for s in list(r["own"]) + list(r["peer"])}, reverse=True)
        return next((s for s in steps if self._plan(reports, s) is not None), None)

    def load(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore ``step`` into model and optimizer (collective). Returns the trainer state (with ``step``)."""
        self.wait()
        reports = all_gather_object(self._report())
        plan = self._plan(reports, step)
        if plan is None:
            raise SnapshotError(f"in-memory snapshot of step {step} is not complete on every rank")
        blob = None
        if plan[self.rank] == self.rank:
            blob = self._read(self._files(self.own_dir)[step])
        if self.world > 1:
            # The peer of a rank whose own copy is gone sends that rank its copy back.
            send_to = self.source if (self.source is not None and plan[self.source] == self.rank
                                      and self.source != self.rank) else None
            need = plan[self.rank] != self.rank
            out = self._read(self._files(self.peer_dir)[step]) if send_to is not None else None
            got = self._exchange(out, send_to, self.peer if need else None,
                                 recv_size=reports[self.peer]["peer"][step] if need else 0)
            if need:
                blob = got
                self._write(self.own_dir, step, blob)
        def check(meta: dict) -> None:
            if meta.get("rank") != self.rank or meta.get("step") != step:
                raise SnapshotError(f"snapshot step-{step} of rank {self.rank}: belongs to rank {meta.get('rank')}")
        return load_state_blob(blob, model, optimizer, f"snapshot step-{step} of rank {self.rank}", check)

    def clear(self) -> None:
        """Drop this rank's snapshots (after a clean finish; frees the RAM)."""
        with contextlib.suppress(OSError):  # a snapshot that failed to store is dropped all the same
            self.wait()
        shutil.rmtree(self.job_dir / f"rank-{self.rank}", ignore_errors=True)
        try:
            self.job_dir.rmdir()
        except OSError:
            pass


def state_blob(model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
               trainer_state: dict[str, Any]) -> bytearray:
    """This rank's local shard of the model and optimizer, ``trainer_state`` (JSON) and its RNG as one
    sealed blob, now (the format of a snapshot; a rejoining replica group receives one live)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return BlobLayout.seal(BlobLayout({"meta": meta, "model": model_sd, "optim": optim_sd,
                                       "trainer": trainer_state, "rng": rng_state()}).fill())


def load_state_blob(blob: bytes | bytearray, model: torch.nn.Module, optimizer: torch.optim.Optimizer, what: str,
                    check=None) -> dict[str, Any]:
    """Restore a :func:`state_blob` into model, optimizer and RNG (its checksum verified; ``check(meta)``
    may refuse it first). Returns its trainer state."""
    state = deserialize(blob, what)
    if check is not None:
        check(state.get("meta", {}))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd = restore_into(model_sd, state["model"], "model")
    optim_sd = restore_into(optim_sd, state["optim"], "optim")
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    set_rng_state(state["rng"])
    return state["trainer"]
