"""The checkpointer decides when training state is saved, where, and what a run resumes from.

It composes one state from the stateful pieces (model, optimizer, the training counters, the
learning-rate schedule, the data position, RNG) and owns every choice the loop used to make:
the disk interval and async commit (``checkpoint.interval``, ``async_save``), the in-memory tier
(``memory_interval``), what to resume from (the newest of an in-memory snapshot and a verified disk
checkpoint, else a Hugging Face directory, else the seeded initialisation), and the final save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from stalwart.checkpoint.manager import (CheckpointError, CheckpointManager, PeerCheckpointError,
                                         newest_complete_checkpoint)
from stalwart.checkpoint.writer import TRAINER_STATE, all_gather_object
from stalwart.checkpoint.snapshot import SnapshotStore, load_state_blob, state_blob
from stalwart.paths import CheckpointDir, RunPaths, checkpoint_step
from stalwart.train.demotion import RestoreWatch
from stalwart.train.preempt import Preempted, PreemptionSignal


SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "tie_embeddings",
                "embed_dim")
SHAPE_DEFAULTS = {"embed_dim": 0}  # fields checkpoints written before them do not carry


def _shape(a: dict) -> str:
    return (f"dim {a.get('dim')}, {a.get('n_layers')} layers, {a.get('n_heads')} heads ({a.get('n_kv_heads')} "
            f"key/value), ffn {a.get('ffn_hidden')}, vocab {a.get('vocab_size')}, "
            f"{'tied' if a.get('tie_embeddings') else 'untied'} embeddings"
            + (f", embeddings of {a['embed_dim']}" if a.get("embed_dim") else ""))


class Checkpointer:
    """``cfg`` is the ``checkpoint`` section; ``core`` a :class:`~stalwart.train.core.TrainCore`;
    ``stateful`` further pieces with ``state_dict``/``load_state_dict`` (e.g. ``{"data": loader}``)."""

    def __init__(self, cfg, paths: RunPaths, env, core, stateful: dict[str, Any], log_event,
                 describe: dict[str, Any], phase=None) -> None:
        self.cfg, self.paths, self.env, self.core = cfg, paths, env, core
        self.stateful = {"schedule": core.schedule, **stateful}
        self.log_event = log_event
        self._phase = phase or (lambda name: contextlib.nullcontext())
        self.manager = CheckpointManager(paths.checkpoints, cfg, env.rank, env.world_size, log_event,
                                         describe=describe)
        self.snapshots = None
        if cfg.memory_interval:
            self.snapshots = SnapshotStore(paths.snapshots(cfg.memory_dir), env.rank, env.world_size,
                                           env.local_world_size, layout=core.dims.describe())
        self.preemption = PreemptionSignal()  # the loop enters it: SIGTERM -> save this step, exit 75
        self.watch = RestoreWatch(paths, env.rank == 0, cfg.demote_after, log_event)
        self.manager.skip_steps = self.watch.steps("disk")
        self.resumed_from: Path | None = None
        self.initialized_from: str | None = None  # a Hugging Face directory the weights came from
        self.disk_loads = 0  # disk checkpoints loaded by this process (a single controller reports it)

    @staticmethod
    def refuse_overwrite(cfg, paths: RunPaths) -> None:
        """``checkpoint.resume = none`` on a run that has checkpoints: stop before anything is written."""
        if cfg.resume == "none" and CheckpointDir(paths.checkpoints).complete():
            raise CheckpointError(
                f"run directory {paths.root} already holds checkpoints and checkpoint.resume = none; use "
                "--checkpoint.resume auto to continue it, or choose another --run.dir")

    @staticmethod
    def refuse_other_shape(cfg, paths: RunPaths, args) -> None:
        """The checkpoint a resume would load holds a model of another shape than ``args`` (the config's,
        resolved): stop with one line naming both, before any process group or file is touched."""
        path = Path(cfg.resume) if cfg.resume not in ("auto", "none") else (
            newest_complete_checkpoint(paths.checkpoints) if cfg.resume == "auto" else None)
        try:
            saved = json.loads((path / TRAINER_STATE).read_text())["model_args"] if path else None
        except (OSError, ValueError, KeyError, TypeError):
            return  # unreadable: the load itself names what is wrong
        want = dataclasses.asdict(args)
        if isinstance(saved, dict) and any(saved.get(k, SHAPE_DEFAULTS.get(k)) != want[k] for k in SHAPE_FIELDS):
            owner = RunPaths.holding(path)
            fix = (f"or resume with the config it was trained with (--config {owner.config})" if owner else
                   "or give the model settings it was trained with")
            raise CheckpointError(f"checkpoint {path} holds a model of another shape ({_shape(saved)}) than the "
                                  f"config asks for ({_shape(want)}); train into another --run.dir, {fix}")

    # ------------------------------------------------------------------ state
    def trainer_state(self) -> dict[str, Any]:
        """The JSON part of a checkpoint (the step is added by the writer)."""
        return {"tokens_seen": self.core.state.tokens_seen,
                **{name: obj.state_dict() for name, obj in self.stateful.items()},
                "model_args": dataclasses.asdict(self.core.spec.model_args)}

    def _load_trainer_state(self, step: int, st: dict[str, Any]) -> None:
        self.core.state.step, self.core.state.tokens_seen = step, int(st["tokens_seen"])
        for name, obj in self.stateful.items():
            obj.load_state_dict(st[name])

    def state_blob(self) -> bytearray:
        """This rank's whole training state now, as one sealed blob (a rejoining replica group's transfer)."""
        step = self.core.state.step
        return state_blob(self.core.model, self.core.optimizer, {"step": step, "rank": self.env.rank},
                          {"step": step, **self.trainer_state()})

    def restore_blob(self, blob: bytes | bytearray, source: str) -> int:
        """Restore a :meth:`state_blob` sent by ``source`` (words for the event); returns its step."""
        st = load_state_blob(blob, self.core.model, self.core.optimizer, f"training state from {source}")
        self._load_trainer_state(int(st["step"]), st)
        self.resumed_from = None
        return int(st["step"])

    def restore(self) -> str | None:
        """Resume from the best state available (``memory`` or ``disk``, returned), or initialise from
        Hugging Face weights (None). Demoted sources (``train/demotion.py``) are passed over."""
        model, optimizer = self.core.model, self.core.optimizer
        path = self.manager.resolve_resume()
        disk_step = checkpoint_step(path) if path is not None else -1
        snap = self.snapshots.newest_complete_step() if (
            self.snapshots is not None and self.cfg.resume == "auto") else None
        if snap is not None and snap in self.watch.steps("memory"):
            snap = None
        extra: dict[str, Any] = {}
        if snap is not None and snap > disk_step:
            self.manager.drop_verified()
            st = self.snapshots.load(snap, model, optimizer)
            source, step, path = "memory", int(st["step"]), self.snapshots.job_dir
        elif path is not None:
            loaded = self.manager.load_resume(path, model, optimizer)
            self.disk_loads += 1
            st, source, step, path = loaded.trainer_state, "disk", loaded.step, loaded.path
            # How the ranks split the reading: each checks the shard files it wrote and reads records of
            # the others only where its part of the state is in them (collective, like the load).
            split = all_gather_object((len(loaded.files_checked), len(loaded.files_in_part), loaded.bytes_in_part))
            checked, in_part, in_part_bytes = zip(*split)
            extra = {"shard_files_checked": list(checked), "shard_files_read_in_part": list(in_part),
                     "shard_bytes_read_in_part": list(in_part_bytes)}
        else:
            if self.cfg.init_from_hf:
                from stalwart.export.hf import load_hf_into

                load_hf_into(model, self.core.spec.model_args, self.cfg.init_from_hf)
                self.initialized_from = self.cfg.init_from_hf
                self.log_event("initialized", source="hf", path=self.cfg.init_from_hf)
            return None
        self._load_trainer_state(step, st)
        self.resumed_from = path
        self.log_event("resumed", step=step, path=str(path), source=source, **extra)
        self.watch.restored(source, step)
        return source

    def restore_from(self, source: str) -> int | None:
        """Restore the newest state of one kind, ``"memory"`` (a complete in-memory snapshot) or
        ``"disk"`` (a verified checkpoint), without looking at the other (collective). Returns its step,
        or None when there is none (the state is then left as it is). A single controller's recovery
        uses it: what it restores from is its decision, not the newest of both."""
        model, optimizer = self.core.model, self.core.optimizer
        if source == "memory":
            step = self.snapshots.newest_complete_step() if self.snapshots is not None else None
            if step is None:
                return None
            st = self.snapshots.load(step, model, optimizer)
            self._load_trainer_state(int(st["step"]), st)
            return int(st["step"])
        path = newest_complete_checkpoint(self.paths.checkpoints)
        if path is None:
            return None
        loaded = self.manager.load_resume(path, model, optimizer)
        self.disk_loads += 1
        self._load_trainer_state(loaded.step, loaded.trainer_state)
        return loaded.step

    # ------------------------------------------------------------------ saving
    def save(self, block: bool = False, last: bool = False) -> Path | None:
        """Start a checkpoint (async: returns after staging); ``block`` waits until it is committed;
        ``last``: the session's last save (nothing trains after it, whether it fails or not)."""
        return self.manager.save(self.core.state.step, self.core.model, self.core.optimizer,
                                 self.trainer_state(), block=block, last=last)

    def maybe_save(self, step: int, end: int, record: dict[str, Any] | None = None) -> None:
        """After step ``step`` (whose ``record`` tells how it went): commit a finished async save; demote a
        restored state whose steps go non-finite and restore the next; on preemption save this step and
        stop; snapshot / checkpoint at their intervals (the final step is saved by ``finish``)."""
        stop = step < end and self.preemption.agreed()  # collective: every rank stops after the same step
        self.manager.poll()  # commits an async save once every rank's write is durable
        # Only under the SPMD loop (which enters ``preemption``): a controller decides its recoveries itself.
        if record is not None and self.preemption.active and self.watch.step_done(record):
            self._demote_and_restore()
            return
        if stop:
            self._save_and_stop(step)
        if step == end or self.watch.suspect:  # never save a state that went non-finite since its restore
            return
        if self.snapshots is not None and step % self.cfg.memory_interval == 0:
            self.snapshots.save_async(step, self.core.model, self.core.optimizer, self.trainer_state())
        if self.cfg.interval and step % self.cfg.interval == 0:
            with self._phase("checkpoint"):
                self.save()

    @contextlib.contextmanager
    def watching(self):
        """Around a step: a non-finite rollback (``fault.nonfinite = rollback``) right after a restore
        counts against the restored source before the group restarts."""
        from stalwart.ft.guard import RollbackRequested

        try:
            yield
        except RollbackRequested as e:
            if str(e).startswith("non-finite"):  # a loss spike is not the state's fault
                self.watch.rolled_back()
            raise

    def _demote_and_restore(self) -> None:
        """The restored state went non-finite ``demote_after`` steps in a row: demote its source and restore
        the next one (collective: every rank decides alike from the agreed loss and gradient norm)."""
        entry = self.watch.demote()
        if self.env.rank == 0:
            print(f"warning: the {entry['bad_steps']} steps after restoring the {entry['source']} state of step "
                  f"{entry['step']} all went non-finite: that source is demoted; restoring from the next saved "
                  "state", file=sys.stderr, flush=True)
        self.manager.wait()
        self.manager.skip_steps = self.watch.steps("disk")
        if self.restore() is None:
            raise CheckpointError(
                f"the {entry['source']} state of step {entry['step']} went non-finite after it was restored and no "
                "older saved state is left to restore; fix the cause (learning rate, data), then resume from a "
                "chosen checkpoint with --checkpoint.resume PATH or start over")

    def _save_and_stop(self, step: int) -> None:
        """Preempted (SIGTERM): checkpoint this step, blocking, then raise :class:`Preempted` on every rank.
        A save that fails (under ``on_failure = continue``) still stops: the newest complete checkpoint
        is what the requeued job resumes from."""
        t0 = time.perf_counter()
        with self._phase("checkpoint"):
            path = self.save(block=True, last=True)
        seconds = self.preemption.seconds_since()
        error = None if path is not None else self.manager.last_error
        with contextlib.suppress(OSError):  # the step's end -> durable is save_s; the rest finished the step
            self.log_event("preempted", step=step, checkpoint=str(path) if path else None,
                           signal_to_durable_s=round(seconds, 3), save_s=round(time.perf_counter() - t0, 3),
                           error=error)
        raise Preempted(step, str(path) if path else None, seconds, error)

    def finish(self, trained: bool, stopped_early: bool) -> Path | None:
        """End of a session: the final save (when anything was trained), then every save committed.
        Returns the checkpoint that holds the final state, if any."""
        ckpt = self.resumed_from if not trained else None
        if trained and (self.cfg.at_end or stopped_early):
            ckpt = self.save(block=True, last=True)
            if ckpt is None:  # failed under on_failure = continue: the session's end is not durable
                self._final_save_failed()
        self.manager.wait()  # an in-flight async save commits before exit
        if self.snapshots is not None and not stopped_early:
            self.snapshots.clear()  # finished: the final disk checkpoint supersedes them
        return ckpt

    def _final_save_failed(self) -> None:
        step = self.core.state.step
        newest = newest_complete_checkpoint(self.paths.checkpoints)
        durable = checkpoint_step(newest) if newest is not None else None
        with contextlib.suppress(OSError):  # the disk may be what failed
            self.log_event("final_save_failed", step=step, durable_step=durable, error=self.manager.last_error)
        error = CheckpointError if self.env.rank == 0 else PeerCheckpointError  # every rank fails alike: one line
        raise error(
            f"the final checkpoint (step {step}) was not saved: {self.manager.last_error}; " + (
                f"the newest durable checkpoint is step {durable}, which a rerun resumes from" if durable is not None
                else "no checkpoint of this run is durable, so a rerun starts over"))
