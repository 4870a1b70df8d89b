"""The trainer actor: one Monarch actor process running the training core over its own process group,
on the device ``training.device`` resolves to for its rank (``runtime.device``), as an SPMD worker.

The actor builds the same components as an SPMD worker (``stalwart.train.trainer.Trainer``: core,
observer, guard, fault injection, evaluator, checkpointer), but it has no loop: the controller sends
``step(n, micro_batches, data_position_after)`` and the actor runs ``Trainer.step`` on exactly those
batches: the SPMD loop's own step (observed, guarded, trained, then metrics, evaluation, snapshot,
checkpoint, each component deciding whether it acts). Rank 0's observer writes ``metrics.jsonl`` /
``events.jsonl`` as in an SPMD run.

After a failure the surviving actors ``join`` a new process group (a group that lost a member cannot
be reused; ``runtime.group.join_attempt`` joins attempt *k* under its own key prefix): the old
components are closed and rebuilt over the new group in the same process, and ``restore`` loads the
state the controller chose (``memory``: this actor's in-memory snapshot; ``disk``: the newest
checkpoint). ``disk_loads`` in every reply counts the disk checkpoints this process ever loaded, so a
recovery that must not touch the disk can be checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

from monarch.actor import Actor, endpoint

from stalwart.config.job import JobConfig


class TrainerActor(Actor):
    def __init__(self) -> None:
        self.trainer = None
        self.rank = -1
        self._stack: contextlib.ExitStack | None = None
        self._disk_loads = 0

    def _reply(self, **fields: Any) -> dict[str, Any]:
        disk = self._disk_loads + (self.trainer.checkpointer.disk_loads if self.trainer is not None else 0)
        return {"rank": self.rank, "pid": os.getpid(), "disk_loads": disk, **fields}

    def _close(self) -> None:
        """Leave the current components' contexts (heartbeat thread, flight recorder, files)."""
        if self._stack is not None:
            with contextlib.suppress(Exception):
                self._stack.close()
        if self.trainer is not None:
            self._disk_loads += self.trainer.checkpointer.disk_loads
        self._stack, self.trainer = None, None

    @endpoint
    def warm(self) -> int:
        """A spare's start: the imports a join needs, done before any failure. Returns the pid."""
        import stalwart.train.trainer  # noqa: F401 - torch, the model, the components

        return os.getpid()

    @endpoint
    def join(self, cfg: JobConfig, rank: int, world: int, store_port: int, attempt: int,
             collective_timeout_s: float, setup_s: float) -> dict[str, Any]:
        """Join process group ``attempt`` as ``rank`` of ``world`` (on this rank's device: the actors
        share one host, so rank is the local rank) and build the components on it."""
        import torch

        from stalwart.runtime.device import resolve_device
        from stalwart.runtime.group import join_attempt
        from stalwart.train.trainer import Trainer

        self._close()
        self.rank = rank
        os.environ.setdefault("OMP_NUM_THREADS", str(cfg.launch.threads(world)))
        torch.set_num_threads(cfg.launch.threads(world))
        device = resolve_device(cfg.training.device, local_rank=rank, setting="training.device")
        env = join_attempt(rank, world, store_port, attempt, device, collective_timeout_s, setup_s)
        if attempt > 0:  # the run's checkpoints are this job's own now: a rebuild never refuses them
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"))
        self.trainer = Trainer(cfg, env)
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self.trainer.observer)
        self._stack.enter_context(self.trainer.guard)
        if self.trainer.injector is not None:
            self._stack.enter_context(self.trainer.injector)
        return self._reply(attempt=attempt)

    @endpoint
    def begin(self) -> dict[str, Any]:
        """A session's start, as the SPMD loop begins: resume (the checkpointer chooses), announce."""
        t = self.trainer
        t.begin()
        ck = t.checkpointer
        source = ("init" if ck.resumed_from is None else
                  "memory" if ck.snapshots is not None and ck.resumed_from == ck.snapshots.job_dir else "disk")
        return self._reply(step=t.state.step, data=t.loader.state_dict(), end=t.end, source=source)

    @endpoint
    def restore(self, source: str, session_start: int) -> dict[str, Any]:
        """Recovery: load the newest ``source`` state ("memory" or "disk"); without one the seeded
        initialisation stays (the journal is then replayed from the session's start)."""
        t = self.trainer
        t.start_step = session_start
        step = t.checkpointer.restore_from(source)
        if step is None and source == "memory":  # no complete snapshot yet: the newest checkpoint, if any
            source = "disk"
            step = t.checkpointer.restore_from(source)
        if step is None:
            source = "init"
        t.guard.resumed(t.state.step)
        return self._reply(step=t.state.step, source=source, data=t.loader.state_dict())

    @endpoint
    def step(self, n: int, packed: list, data_after: dict) -> dict[str, Any]:
        """Optimizer step ``n`` on this rank's micro-batches (``feed.pack``ed), then the components act."""
        from stalwart.controller.feed import unpack

        t0 = time.perf_counter()
        micro = unpack(packed)
        t = self.trainer
        if t.state.step + 1 != n:
            raise RuntimeError(f"actor {self.rank} is at step {t.state.step}; step {n} cannot follow it")
        record = t.step(micro, data_after)
        return self._reply(actor_s=time.perf_counter() - t0,
                           **{k: v for k, v in record.items() if isinstance(v, (int, float, bool, str))})

    @endpoint
    def finish(self) -> dict[str, Any]:
        """The session's end (final evaluation, save, summary), then leave the group."""
        from stalwart.runtime.group import leave

        summary = self.trainer.finish()
        reply = self._reply(summary=summary)
        self._close()
        leave()
        return reply
