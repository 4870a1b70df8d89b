"""Sharded, atomic, verified checkpoints of the whole training state, saved synchronously or async.

A checkpoint is written under ``checkpoints/.tmp-step-N``; every rank writes its DCP shard, its RNG
state and a manifest of SHA-256 checksums of the files it wrote; after every rank's write is durable,
rank 0 writes DCP's ``.metadata``, merges the manifests into ``manifest.json``, fsyncs, renames the
directory to ``step-N`` and updates ``latest``. A directory named ``step-N`` is therefore always
complete, and a crash mid-save leaves only a ``.tmp-*`` directory that is never loaded. Loading
verifies every checksum first.

Async saves (``checkpoint.async_save``) stall the loop only to copy the state to host memory and plan;
the shard files are written by a background thread that issues no collectives. The commit (the
collectives that check every rank finished, then the rename) runs on the main thread at the next step
boundary where all ranks are done (``poll``), or before the next save / at exit (``wait``).

A failed save (disk full, read-only storage) is logged as ``checkpoint_failed``, its partial
directory removed, and training continues (``checkpoint.on_failure = "continue"``) or stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from stalwart.atomic import describe_write_failure, fsync_dir, storage_problem, write_json_atomic, write_text_atomic
from stalwart.checkpoint import writer as _writer
from stalwart.checkpoint.direct_io import HASH, file_digest
from stalwart.checkpoint.loader import LoadedState, load_verified, rng_state, set_rng_state  # noqa: F401 - API
from stalwart.checkpoint.staging import HostStager, StepHold
from stalwart.checkpoint.verify import (MANIFEST, CheckpointError, PeerCheckpointError, VerifiedFiles,
                                        verify_checkpoint)
from stalwart.checkpoint.writer import SaveJob, all_gather_object, distributed, fsync_file, plan_save, write_local
from stalwart.paths import CheckpointDir, checkpoint_step


def _barrier() -> None:
    if distributed():
        dist.barrier()


def _first_error(errors: list[str | None]) -> str | None:
    return next((e for e in errors if e), None)


@dataclass
class _Pending:
    step: int
    tmp: Path
    final: Path
    future: Future
    t0: float
    stall_s: float
    staging: StepHold | None = None


class CheckpointManager:
    """Save, find, verify and load checkpoints of one run. ``cfg`` is the ``checkpoint`` section.

    Every method that saves (``save``, ``poll``, ``wait``) is collective: all ranks call it at the
    same step, on their main thread.
    """

    def __init__(self, root: Path, cfg, rank: int, world_size: int, log_event: Callable[..., None],
                 describe: dict[str, Any] | None = None) -> None:
        self.root, self.cfg = Path(root), cfg
        self.dir = CheckpointDir(self.root)
        self.rank, self.world_size = rank, world_size
        self.log_event = log_event
        self.describe = describe or {}
        self.async_save = bool(getattr(cfg, "async_save", False))
        self.on_failure = getattr(cfg, "on_failure", "continue")
        self._stager = HostStager()
        self._pending: _Pending | None = None
        self.last_saved: Path | None = None
        self.last_error: str | None = None  # why the newest failed save failed
        self._last_save = False  # the save in progress is the session's last (no training follows it)
        self.last_stall_s = 0.0
        self._verified: VerifiedFiles | None = None  # the last checkpoint verified for loading
        self.skip_steps: set[int] = set()  # demoted checkpoints: never resumed from (train/demotion.py)

    # ------------------------------------------------------------------ save
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any], block: bool = False, last: bool = False) -> Path | None:
        """Start a checkpoint of the current state. Returns at once (async: the state is copied to host
        buffers on the writer thread while the loop computes; the optimizer's next step waits for the copy)
        or once committed.

        Returns the committed path (sync / ``block``), or None while an async save is in flight or when
        the save failed under ``on_failure = continue``. ``last``: the session's last save (at its end,
        or on SIGTERM): a failure is then not followed by more training, and its warning says so.
        """
        self._last_save = last
        self.wait()  # one save in flight at a time: the previous one commits first
        t0 = time.perf_counter()
        tmp, final = self.dir.tmp(step), self.dir.step(step)
        err = None
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                err = self._no_room(tmp)
                if err is None:
                    tmp.mkdir()
            except OSError as e:
                err = storage_problem(e, tmp) or f"cannot create {tmp}: {e}"
        errors = all_gather_object(err)
        if _first_error(errors):
            return self._fail(step, tmp, _first_error(errors))
        background = self.async_save and not block
        rng, trainer = rng_state(), ({"step": step, **trainer_state} if self.rank == 0 else None)
        future: Future = Future()  # -> (SaveJob, DCP write results)
        # The state dict is read here, at the step boundary, never beside the next forward: a unit under
        # the mixed-precision cast holds its bf16 copies in place of its parameters while it runs, and
        # a state dict read then would miss them (or hold the copies).
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if background and not distributed():
            pairs = None  # nothing collective: buffers, copy, planning and writes all go to the writer thread
        else:
            # DCP's planning exchanges plans between ranks: it stays on the main thread with the
            # loop's own collectives; only the copy and the file writes go to the background.
            pairs: list | None = []
            if background:
                state, pairs = self._stager.prepare(state)
            job = plan_save(step, tmp, self.rank, state, rng, trainer)
        staging = StepHold(optimizer) if background else None  # holds optimizer.step until copied
        if background:
            def run() -> None:
                try:
                    try:
                        if pairs is None:
                            staged, copies = self._stager.prepare(state)
                            HostStager.copy(copies)
                        else:
                            HostStager.copy(pairs)
                    finally:
                        staging.done.set()
                    own = job if pairs is not None else plan_save(step, tmp, self.rank, staged, rng, trainer)
                    future.set_result((own, write_local(own)))
                except BaseException as e:  # noqa: BLE001 - reported at commit, on the main thread
                    future.set_exception(e)
            threading.Thread(target=run, name=f"checkpoint-write-{step}", daemon=False).start()
        else:
            try:
                future.set_result((job, write_local(job)))
            except Exception as e:  # noqa: BLE001
                future.set_exception(e)
        stall = time.perf_counter() - t0
        self.last_stall_s = stall
        self._pending = _Pending(step, tmp, final, future, t0, stall, staging)
        if background:
            return None
        return self.wait()

    def poll(self) -> None:
        """At a step boundary: commit the in-flight save if every rank's write has finished."""
        if self._pending is None:
            return
        staging = self._pending.staging
        if staging is not None and staging.done.is_set():  # the copy is done: drop the optimizer hook
            self._pending.stall_s += staging.close()
            self._pending.staging = None
        done = int(self._pending.future.done())
        if distributed():
            flag = torch.tensor([done], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            done = int(flag.item())
        if done:
            self.wait()

    def wait(self) -> Path | None:
        """Block until the in-flight save (if any) is durable on every rank, then commit it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if pending.staging is not None:
            pending.stall_s += pending.staging.close()
        job, results, err = None, None, None
        try:
            job, results = pending.future.result()
        except Exception as e:  # noqa: BLE001
            err = f"rank {self.rank}: {describe_write_failure(e, pending.tmp)}"
        gathered = all_gather_object((err, results))
        err = _first_error([e for e, _ in gathered])
        if err is None and self.rank == 0:
            try:
                self._commit(job, pending.final, [r for _, r in gathered])
            except OSError as e:
                err = f"rank 0: committing {pending.final.name}: {describe_write_failure(e, pending.tmp)}"
        if distributed():
            box = [err]
            dist.broadcast_object_list(box, src=0)
            err = box[0]
        if err:
            return self._fail(pending.step, pending.tmp, err)
        self.last_saved = pending.final
        if self.rank == 0:
            self.log_event("checkpoint_saved", step=pending.step, path=str(pending.final),
                           seconds=time.perf_counter() - pending.t0, stall_s=pending.stall_s,
                           async_save=self.async_save)
            self._drop_partials()
            self._apply_retention(keep=pending.final)
        return pending.final

    def _drop_partials(self) -> None:
        """Remove ``.tmp-step-*`` directories: after a commit none is being written (one save in flight),
        so any left is a killed save's, holding disk space. Never fails the save."""
        for path in sorted(self.root.glob(".tmp-step-*")):
            try:
                shutil.rmtree(path)
                self.log_event("checkpoint_partial_removed", path=str(path))
            except OSError as e:
                self.log_event("checkpoint_delete_failed", path=str(path), error=str(e))

    def _commit(self, job: SaveJob, final: Path, results: list[Any]) -> None:
        tmp = job.tmp
        job.writer.finish(metadata=job.metadata, results=results)
        fsync_file(tmp / ".metadata")
        _writer.fault_point("after_metadata")
        files: dict[str, Any] = {}
        for r in range(self.world_size):
            part = tmp / f"manifest-rank{r}.json"
            files.update(json.loads(part.read_text()))
        for name in (".metadata",):
            files[name] = {HASH: file_digest(tmp / name), "bytes": (tmp / name).stat().st_size}
        manifest = {"step": job.step, "files": files, "world_size": self.world_size,
                    "created": time.time(), **self.describe}
        write_json_atomic(tmp / MANIFEST, manifest)
        for r in range(self.world_size):
            (tmp / f"manifest-rank{r}.json").unlink()
        fsync_dir(tmp)
        _writer.fault_point("before_rename")
        if final.exists():  # a stale checkpoint of the same step from an abandoned trajectory
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.root)
        _writer.fault_point("after_rename")
        write_text_atomic(self.dir.latest, final.name + "\n")
        fsync_dir(self.root)

    def _no_room(self, tmp: Path) -> str | None:
        """Why a save must not start: the newest checkpoint's size does not fit in the free space. A save
        that filled the device would fail anyway, and meanwhile starve every other write of the run (its
        metrics, events and timings), which cannot fail over to the next interval the way a checkpoint
        does."""
        newest = newest_complete_checkpoint(self.root)
        if newest is None:
            return None
        need = sum(f.stat().st_size for f in newest.iterdir() if f.is_file())
        free = shutil.disk_usage(self.root).free
        reserve = 1 << 20  # room left for the run's records
        if free >= need + reserve:
            return None
        return (f"no space left on the device writing {tmp}: {newest.name} took {need / 2**20:.1f} MiB and "
                f"{free / 2**20:.1f} MiB are free (not started, so the run's own records keep their room)")

    def _fail(self, step: int, tmp: Path, error: str) -> None:
        """Every rank agrees the save failed: report it, drop the partial directory, continue or stop."""
        _barrier()  # nobody still writes into tmp
        if self.rank == 0:
            removed = True
            try:
                shutil.rmtree(tmp)
            except FileNotFoundError:
                pass
            except OSError:
                removed = False
                with contextlib.suppress(OSError):  # quarantine: never looks like a checkpoint
                    os.replace(tmp, self.dir.failed(step, int(time.time())))
            with contextlib.suppress(OSError):  # the disk may be what failed
                self.log_event("checkpoint_failed", step=step, error=error, partial_removed=removed,
                               on_failure=self.on_failure)
            print(f"warning: checkpoint step-{step} failed: {error}; {self._after_failure()}", file=sys.stderr,
                  flush=True)
        _barrier()
        self.last_error = error
        if self.on_failure == "stop":
            raise CheckpointError(f"checkpoint step-{step} failed: {error} (checkpoint.on_failure = stop)")

    def _after_failure(self) -> str:
        """What a failed save leaves, in words: training goes on (a save at an interval), or, for the
        session's last save, which checkpoint a rerun resumes from."""
        if not self._last_save:
            return "the previous checkpoint is kept" + ("" if self.on_failure == "stop" else ", training continues")
        newest = newest_complete_checkpoint(self.root)
        return (f"this session ends without it; a rerun resumes from {newest.name}, the newest complete checkpoint"
                if newest is not None else "this session ends without it; no checkpoint is complete, so a rerun "
                "starts over")

    def _apply_retention(self, keep: Path) -> None:
        """Keep the newest ``keep_last`` plus every ``keep_every``-th step; never the only complete one."""
        keep_last, keep_every = self.cfg.keep_last, getattr(self.cfg, "keep_every", 0)
        if not keep_last:
            return
        complete = self.complete_checkpoints()
        recent = set(complete[-keep_last:]) | {keep}
        for path in complete:
            step = checkpoint_step(path)
            if path in recent or (keep_every and step % keep_every == 0):
                continue
            if len(self.complete_checkpoints()) <= 1:  # never delete the only complete checkpoint
                break
            try:
                shutil.rmtree(path)
                self.log_event("checkpoint_deleted", path=str(path))
            except OSError as e:  # a failed deletion must never stop training
                self.log_event("checkpoint_delete_failed", path=str(path), error=str(e))

    # ------------------------------------------------------------------ find
    def complete_checkpoints(self) -> list[Path]:
        """``step-N`` directories, oldest first (``.tmp-*`` ones are partial and ignored)."""
        return self.dir.complete()

    def verify(self, path: Path, keep: bool = False, share: bool = False) -> dict[str, Any]:
        """Check the manifest and every file's size and checksum; raise CheckpointError naming the bad file.
        ``keep``: check the manifest, sizes and small files now and stream the shard files into memory
        for ``load(path)``, which checks their digests (a bad one is refused, and fallen back past, at load).
        ``share``: the ranks split the shard files' checksums between them (``load_resume`` agrees on
        the outcome)."""
        self.drop_verified()
        files = verify_checkpoint(path, keep=keep, rank=self.rank,
                                  share=(self.rank, self.world_size) if share else None)
        if keep:
            self._verified = files
        return files.manifest

    def drop_verified(self) -> None:
        """Forget the checkpoint ``resolve_resume`` started reading (another source was chosen)."""
        if self._verified is not None:
            self._verified.release()
        self._verified = None

    def resolve_resume(self, before: int | None = None, full: bool = False) -> Path | None:
        """The checkpoint to resume from under ``checkpoint.resume``, falling back past bad ones. Its shard
        files start streaming in for ``load_resume``, which compares their checksums (and falls back past
        a bad one); ``full``: compare every checksum before choosing (for tools that read the files
        themselves)."""
        mode = self.cfg.resume
        if mode == "none":
            return None
        if mode != "auto":
            path = Path(mode)
            if not path.is_dir():
                raise CheckpointError(f"checkpoint.resume: '{mode}' is not a checkpoint directory")
            self.verify(path, keep=not full, share=not full)
            return path
        for path in reversed(self.complete_checkpoints()):
            if (before is not None and checkpoint_step(path) >= before) or checkpoint_step(path) in self.skip_steps:
                continue
            try:
                self.verify(path, keep=not full, share=not full)
                return path
            except CheckpointError as e:
                self._fall_back(path, e)
        return None

    def _fall_back(self, path: Path, e: CheckpointError) -> None:
        self.log_event("checkpoint_fallback", path=str(path), error=str(e))
        if self.rank == 0:
            print(f"warning: {e}; falling back to an older checkpoint", flush=True)

    def load_resume(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> LoadedState:
        """Load ``path`` (from ``resolve_resume``). Under ``resume = auto`` a checkpoint refused at load
        although it passed its checksums (crafted, or from another model) is bad like a corrupt one:
        fall back to the next older good one. With none left, the refusal stands."""
        while True:
            loaded, own = None, None
            try:
                loaded = self.load(path, model, optimizer, share=True)
            except CheckpointError as e:
                own = e
            # Every rank decides alike: a file only one rank reads (its RNG state, its shard) may fail there.
            errors = [(r, m) for r, m in enumerate(all_gather_object(str(own) if own else None)) if m]
            if not errors:
                return loaded
            rank, message = errors[0]
            e = own or PeerCheckpointError(f"{message} (on rank {rank})")
            older = self.resolve_resume(before=checkpoint_step(path)) if self.cfg.resume == "auto" else None
            if older is None:
                raise e
            self._fall_back(path, e)
            path = older

    # ------------------------------------------------------------------ load
    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             share: bool = False) -> LoadedState:
        """Load from the bytes ``resolve_resume``/``verify(keep=True)`` are streaming in (else read them now),
        accepted once every checksum matches (``share``: the ranks split the checksums, see ``verify``)."""
        files, self._verified = self._verified, None
        if files is None or files.path != Path(path):
            if files is not None:
                files.release()
            files = verify_checkpoint(path, keep=True, rank=self.rank,
                                      share=(self.rank, self.world_size) if share else None)
        return load_verified(files, self.rank, model, optimizer)


def newest_complete_checkpoint(root: Path) -> Path | None:
    """The newest ``step-N`` under ``root`` that has its manifest (cheap: no checksums)."""
    done = [p for p in CheckpointDir(root).complete() if (p / MANIFEST).is_file()]
    return done[-1] if done else None
