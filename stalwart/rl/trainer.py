"""The policy trainer actor: the reusable training core (``stalwart.train.core``) over its own gloo
group, trained on the rows the controller sends with the GRPO objective (or, while warming up, the
masked cross-entropy of supervised fine-tuning).

Each phase builds its core (``build``): the fine-tuning phase's optimizer, then the RL phase's, the
weights carried over. ``weights`` returns the full (unsharded) state dict on rank 0, whatever the
layout: the controller hands it to the generators as the next weight version. ``snapshot`` and
``restore`` move the full model and optimizer state through the controller, so a replacement actor (a
new process with no state) rejoins with the others at the snapshot's step, and the controller replays
its journal from there.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np
from monarch.actor import Actor, endpoint

from stalwart.config.rl import RLConfig


def to_numpy(tree: Any) -> Any:
    """Tensors in a nested state dict as numpy arrays (plain buffers across processes)."""
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy().copy()
    if isinstance(tree, dict):
        return {k: to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_numpy(v) for v in tree]
    return tree


def to_torch(tree: Any) -> Any:
    import torch

    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree.copy())
    if isinstance(tree, dict):
        return {k: to_torch(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_torch(v) for v in tree]
    return tree


class PolicyTrainerActor(Actor):
    def __init__(self) -> None:
        self.core = None
        self.rank = -1
        self.cfg: RLConfig | None = None

    @endpoint
    def warm(self) -> int:
        import stalwart.train.core  # noqa: F401

        return os.getpid()

    @endpoint
    def join(self, cfg: RLConfig, rank: int, world: int, store_port: int, attempt: int, timeout_s: float,
             setup_s: float) -> dict[str, Any]:
        import torch

        from stalwart.controller.actor import init_group

        torch.set_num_threads(1)
        self.cfg, self.rank, self.world = cfg, rank, world
        self.core = None
        init_group(rank, world, store_port, attempt, timeout_s, setup_s)
        return {"rank": rank, "pid": os.getpid()}

    @endpoint
    def build(self, phase: str, args: Any, row_length: int, micro_per_rank: int, steps: int) -> dict[str, Any]:
        """The core of ``phase`` ("sft" or "rl"); the current core's weights carry over."""
        import torch

        from stalwart.config.job import SchedulerConfig, TrainingConfig
        from stalwart.train.core import CoreSpec, TrainCore
        from stalwart.runtime.env import DistEnv

        c = self.cfg
        opt = c.optimizer if phase == "rl" else dataclasses.replace(c.optimizer, lr=c.sft.lr, weight_decay=0.0)
        training = TrainingConfig(steps=max(steps, 1), global_batch=micro_per_rank * self.world, micro_batch=1,
                                  grad_clip=c.rl.grad_clip, dtype="float32", device="cpu")
        spec = CoreSpec(args, c.parallelism, c.comm, opt, SchedulerConfig(kind="constant", warmup_steps=0), training,
                        row_length, micro_per_rank, seed=c.run.seed, deterministic=c.run.deterministic)
        env = DistEnv(self.rank, self.world, self.rank, self.world, torch.device("cpu"))
        previous = self.core
        self.core = TrainCore.build(spec, env)
        if previous is not None:
            self.core.model.load_state_dict(previous.model.state_dict())
        self.phase = phase
        self.done = 0
        return {"rank": self.rank, "layout": self.core.dims.describe(), "params": sum(
            p.numel() for p in self.core.model.parameters())}

    @endpoint
    def train(self, step: int, updates: list[list[tuple[np.ndarray, np.ndarray]]]) -> dict[str, Any]:
        """Step ``step``: one optimizer step per entry of ``updates`` (this rank's micro-batches of each:
        inputs and packed rows), in order. The log-probability mismatch is measured on the first update
        only: after it the weights are no longer the ones that generated the samples."""
        import torch
        import torch.distributed as dist

        from stalwart.data.loader import Batch
        from stalwart.rl.objective import (
            STATS,
            GRPOObjective,
            masked_cross_entropy,
            summarize,
        )

        t0 = time.perf_counter()
        core = self.core
        if self.done + 1 != step:
            raise RuntimeError(f"trainer {self.rank} has done step {self.done}; step {step} cannot follow it")
        r = self.cfg.rl
        records, stats = [], torch.zeros(len(STATS), dtype=torch.float64)
        for j, micro in enumerate(updates):
            batches = [Batch(torch.from_numpy(x), torch.from_numpy(rows)) for x, rows in micro]
            if self.phase != "rl":
                records.append(core.train_step(batches, loss_fn=masked_cross_entropy))
                continue
            objective = GRPOObjective(r.clip_low, r.clip_high, r.aggregation, r.kl_coef, track_mismatch=j == 0)
            records.append(core.train_step(batches, loss_fn=objective))
            stats[[0, 1, 2, 3, 5, 7, 8]] += objective.stats[[0, 1, 2, 3, 5, 7, 8]]
            stats[[4, 6]] = torch.maximum(stats[[4, 6]], objective.stats[[4, 6]])
        record = {"loss": sum(x["loss"] for x in records) / len(records),
                  "grad_norm": sum(x["grad_norm"] for x in records) / len(records),
                  "lr": records[-1]["lr"], "optimizer_steps": core.state.step, "updates": len(records)}
        if self.phase == "rl":
            if dist.is_initialized():
                maxima = stats[[4, 6]].clone()
                dist.all_reduce(stats)
                dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
                stats[[4, 6]] = maxima
            record.update(summarize(stats))
        self.done = step
        record["trainer_s"] = time.perf_counter() - t0
        return record

    def _full_state(self, optimizer: bool) -> tuple[dict, dict | None]:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
        )

        core = self.core
        if not dist.is_initialized():
            return core.model.state_dict(), (core.optimizer.state_dict() if optimizer else None)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(core.model, [core.optimizer] if optimizer else [], options=opts)
        return model_sd, (optim_sd if optimizer else None)

    @endpoint
    def weights(self) -> dict[str, Any]:
        """The full model state on rank 0 ({} on the others; a collective under sharding)."""
        t0 = time.perf_counter()
        model_sd, _ = self._full_state(False)
        out = to_numpy(dict(model_sd)) if self.rank == 0 else {}
        return {"weights": out, "gather_s": time.perf_counter() - t0, "step": self.done}

    @endpoint
    def snapshot(self) -> dict[str, Any]:
        """Full model and optimizer state with the step counter, on rank 0."""
        model_sd, optim_sd = self._full_state(True)
        if self.rank != 0:
            return {}
        return {"model": to_numpy(dict(model_sd)), "optim": to_numpy(optim_sd), "step": self.done,
                "optimizer_steps": self.core.state.step}

    @endpoint
    def restore(self, snap: dict[str, Any]) -> dict[str, Any]:
        """Load a ``snapshot`` (every rank receives it; each keeps its own shard)."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_state_dict,
        )

        core = self.core
        model_sd, optim_sd = to_torch(snap["model"]), to_torch(snap["optim"])
        if dist.is_initialized():
            set_state_dict(core.model, [core.optimizer], model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=StateDictOptions(full_state_dict=True))
        else:
            core.model.load_state_dict(model_sd)
            core.optimizer.load_state_dict(optim_sd)
        core.state.step = int(snap["optimizer_steps"])
        self.done = int(snap["step"])
        return {"rank": self.rank, "step": self.done}

    @endpoint
    def save_policy(self, root: str) -> str:
        """A checkpoint of the policy (model and optimizer) in Stalwart's checkpoint format under ``root``
        (collective across the trainers under sharding); returns its path."""
        from pathlib import Path

        from stalwart.checkpoint.manager import CheckpointManager
        from stalwart.config.job import CheckpointConfig

        mgr = CheckpointManager(Path(root), CheckpointConfig(async_save=False, keep_last=1), self.rank, self.world,
                                lambda *a, **k: None)
        path = mgr.save(self.done, self.core.model, self.core.optimizer, {"tokens_seen": 0}, block=True)
        return str(path)

    @endpoint
    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
