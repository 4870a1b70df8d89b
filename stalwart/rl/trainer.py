"""The policy trainer actor: the reusable training core (``stalwart.train.core``) over its own process
group, on the device the runtime gives it, trained on the rows the controller sends with the GRPO
objective (or, while warming up, the masked cross-entropy of supervised fine-tuning).

Each phase builds its core (``build``): the fine-tuning phase's optimizer, then the RL phase's, the
weights carried over.

Weights leave a trainer only towards the generators, straight from its own shards: ``link`` joins a
generator's weight link (``comm.weight_sync``) and ``send_weights(version, ...)`` sends this rank's
pieces of the current model over the links named; the controller sees only the version and a small
reply. Snapshots for recovery stay with the trainers too: ``snapshot`` keeps this rank's shard of
the model and optimizer in memory (``checkpoint.snapshot.SnapshotStore``: RAM that outlives the
process, plus a copy on a peer rank), ``restore`` loads the newest snapshot every rank can get (a
replacement process takes its shard from its own tmpfs file or the peer's copy). A change of the
trainer count goes through a checkpoint on disk instead (``save_checkpoint`` / ``load_checkpoint``),
which reshards.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from monarch.actor import Actor, endpoint

from stalwart.config.rl import RLConfig


def _batch(inputs: np.ndarray, rows: np.ndarray, experts: np.ndarray | None = None) -> Any:
    """One micro-batch (``loop.Stepper.pack``): inputs, packed rows and, with routing replay, the
    generator's experts per position (``rl/routing.py``), replayed by the forward."""
    import torch

    from stalwart.data.loader import Batch
    from stalwart.models.moe import Routing

    return Batch(torch.from_numpy(inputs), torch.from_numpy(rows),
                 None if experts is None else Routing(torch.from_numpy(experts)))


def _unrecorded(inputs: np.ndarray, rows: np.ndarray, experts: np.ndarray) -> int:
    """Positions a trained token's log-probability depends on (every one up to its own) that carry no
    recorded experts: 0 when the generator's records cover what the trainer computes."""
    from stalwart.rl.rollout import MASK

    trained = rows[..., MASK] > 0  # (responses, length)
    needed = np.flip(np.maximum.accumulate(np.flip(trained, 1), 1), 1)  # at or before a trained position
    return int((needed & (experts[..., 0, 0] < 0)).sum())


def _replay_figures(replays: list[Any], missing: int, core: Any) -> dict[str, float]:
    """How the replays went, over the data-parallel ranks: the (token, sparse layer) pairs replayed, the
    share of them whose own top-k would have picked other experts, the positions a trained token needs
    that had no record, and the sparse layers per forward that took the replay (every one, or some
    layer was not handed it)."""
    import torch
    import torch.distributed as dist

    sums = torch.tensor([float(sum(int(x.replayed) for x in replays)), float(sum(int(x.differed) for x in replays)),
                         float(missing)], dtype=torch.float64)
    layers = torch.tensor([float(min(x.layers for x in replays))], dtype=torch.float64)
    if core.mesh is not None and core.dims.dp > 1:
        group = core.mesh.dp.get_group()
        dist.all_reduce(sums, group=group)
        dist.all_reduce(layers, op=dist.ReduceOp.MIN, group=group)
    return {"routing_replayed": int(sums[0]), "routing_flip_frac": float(sums[1] / max(float(sums[0]), 1.0)),
            "routing_unrecorded": int(sums[2]), "routing_layers": int(layers[0])}


class PolicyTrainerActor(Actor):
    def __init__(self) -> None:
        self.core = None
        self.rank = -1
        self.cfg: RLConfig | None = None
        self.device = None
        self.links: dict[int, Any] = {}   # generator rank -> its weight link (comm.weight_sync.Link)
        self.snapshots = None              # checkpoint.snapshot.SnapshotStore, per group
        self.done = 0

    @endpoint
    def warm(self) -> int:
        import stalwart.train.core  # noqa: F401

        return os.getpid()

    @endpoint
    def join(self, cfg: RLConfig, rank: int, world: int, store_port: int, attempt: int, timeout_s: float,
             setup_s: float, snapshot_dir: str) -> dict[str, Any]:
        """Join attempt ``attempt`` of the trainers' group as ``rank`` of ``world``, on the device the runtime
        gives this rank; the weight links of an earlier group are dropped."""
        import torch

        from stalwart.checkpoint.snapshot import SnapshotStore
        from stalwart.runtime.group import join_attempt
        from stalwart.runtime.placement import shared_device

        torch.set_num_threads(1)
        self.cfg, self.rank, self.world = cfg, rank, world
        self.core, self.links = None, {}
        self.device = shared_device(cfg.workers.device, rank, "--device")
        join_attempt(rank, world, store_port, attempt, self.device, timeout_s, setup_s)
        self.snapshots = SnapshotStore(snapshot_dir, rank, world, layout=f"trainers={world}")
        return {"rank": rank, "pid": os.getpid(), "device": str(self.device)}

    @endpoint
    def build(self, phase: str, args: Any, row_length: int, micro_per_rank: int, steps: int) -> dict[str, Any]:
        """The core of ``phase`` ("sft" or "rl"); the current core's weights carry over."""
        from stalwart.config.job import SchedulerConfig, TrainingConfig
        from stalwart.parallel.dims import ParallelDims
        from stalwart.runtime.env import DistEnv
        from stalwart.train.core import CoreSpec, TrainCore

        c = self.cfg
        opt = c.optimizer if phase == "rl" else dataclasses.replace(c.optimizer, lr=c.sft.lr, weight_decay=0.0)
        # the RL phase's schedule runs over its optimizer steps (updates_per_step per RL step); the warm-up's is constant
        schedule = c.scheduler if phase == "rl" else SchedulerConfig(kind="constant", warmup_steps=0)
        steps = steps * c.rl.updates_per_step if phase == "rl" else steps
        # NOTE: the objectives read whole logits (entropy, log-probabilities per token), so a tensor-parallel
        # head gathers the vocabulary instead of keeping it sharded for a loss-parallel cross-entropy.
        layout = dataclasses.replace(c.parallelism, loss_parallel=False)
        dp = ParallelDims.resolve(layout, self.world).dp
        training = TrainingConfig(steps=max(steps, 1), global_batch=micro_per_rank * dp, micro_batch=1,
                                  grad_clip=c.rl.grad_clip, dtype="float32", device=self.device.type)
        spec = CoreSpec(args, layout, c.comm, opt, schedule, training,
                        row_length, micro_per_rank, seed=c.run.seed, deterministic=c.run.deterministic)
        previous = self.core
        self.core = TrainCore.build(spec, DistEnv.of(self.rank, self.world, self.device))
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

        from stalwart.rl.objective import STATS, GRPOObjective, masked_cross_entropy, summarize
        from stalwart.rl.rollout import trim
        from stalwart.runtime.device import HOST

        t0 = time.perf_counter()
        core = self.core
        if self.done + 1 != step:
            raise RuntimeError(f"trainer {self.rank} has done step {self.done}; step {step} cannot follow it")
        r = self.cfg.rl
        records, stats = [], torch.zeros(len(STATS), dtype=torch.float64)
        score_s = self._score_exact(updates[1:]) if self.phase == "rl" and self.cfg.exact_on_trainers() else None
        replays, missing = [], 0  # the first update's routing replays (their counts are the step's figures)
        cut = self.phase == "rl" and self.cfg.trims_rows()
        for j, micro in enumerate(updates):
            batches = [_batch(*(trim(packed) if cut else packed)) for packed in micro]
            if j == 0:
                replays += [b.routing for b in batches if b.routing is not None]
                missing += sum(_unrecorded(*packed) for packed in micro if len(packed) > 2)
            if self.phase != "rl":
                records.append(core.train_step(batches, loss_fn=masked_cross_entropy))
                continue
            objective = GRPOObjective(r.clip_low, r.clip_high, r.aggregation, r.kl_coef, track_mismatch=j == 0,
                                      own_old=j == 0 and score_s is not None)
            records.append(core.train_step(batches, loss_fn=objective))
            got = objective.stats.to(HOST)
            stats[[0, 1, 2, 3, 5, 7, 8]] += got[[0, 1, 2, 3, 5, 7, 8]]
            stats[[4, 6]] = torch.maximum(stats[[4, 6]], got[[4, 6]])
        record = {"loss": sum(x["loss"] for x in records) / len(records),
                  "grad_norm": sum(x["grad_norm"] for x in records) / len(records),
                  "lr": records[-1]["lr"], "optimizer_steps": core.state.step, "updates": len(records)}
        if self.phase == "rl":
            if core.mesh is not None and core.dims.dp > 1:  # over the data-parallel ranks (tp ranks agree)
                group = core.mesh.dp.get_group()
                maxima = stats[[4, 6]].clone()
                dist.all_reduce(stats, group=group)
                dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
                stats[[4, 6]] = maxima
            record.update(summarize(stats))
            if score_s is not None:
                record["exact_score_s"] = score_s
        if replays:
            record.update(_replay_figures(replays, missing, core))
        self.done = step
        record["trainer_s"] = time.perf_counter() - t0
        return record

    def _score_exact(self, updates: list[list[tuple[np.ndarray, ...]]]) -> float:
        """Exact old log-probabilities from this layout's own forward (``RLConfig.exact_on_trainers``). The
        step's first update takes them from its own forward (``GRPOObjective(own_old=True)``: it runs on the
        weights that generated the samples); the later updates' micro-batches (``updates``) are scored here,
        before the first update, by a no-grad pass of the same forward that writes each on-policy response
        token's log-probability into the rows, in place."""
        import torch

        from stalwart.rl.objective import token_logprobs
        from stalwart.rl.rollout import MASK, OLD_LOGP, ON_POLICY, TOKEN
        from stalwart.runtime.device import HOST

        t0 = time.perf_counter()
        model = self.core.pm.stages[0]
        with torch.no_grad():
            for micro in updates:
                for packed in micro:
                    batch, rows = _batch(*packed), packed[1]  # with routing replay, its experts replayed here too
                    x = batch.inputs.to(self.device)
                    logits = model(x) if batch.routing is None else model(x, None, routing=batch.routing)
                    tokens = torch.from_numpy(rows[..., TOKEN]).long().to(self.device)
                    logp = token_logprobs(logits, tokens).double().to(HOST).numpy()
                    mine = (rows[..., MASK] > 0) & (rows[..., ON_POLICY] > 0)
                    rows[..., OLD_LOGP] = np.where(mine, logp, rows[..., OLD_LOGP])
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ weights to the generators
    @endpoint
    def link(self, generator: int, attempt: int, generators: int, store_port: int, setup_s: float,
             timeout_s: float, receivers: int = 1) -> dict[str, Any]:
        """Join generator ``generator``'s weight link, attempt ``attempt`` (replacing an earlier one); the
        generator is ``receivers`` processes, each told the part it takes."""
        from stalwart.rl.links import open_link

        self.links.pop(generator, None)  # dropped: its connections close
        try:
            self.links[generator] = open_link(store_port, generator, attempt, self.rank, self.world, generators,
                                              self.device, setup_s, timeout_s, receivers)
        except (RuntimeError, OSError) as e:  # given up by the controller, or a member lost while connecting
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "rank": self.rank, "generator": generator, "attempt": attempt}

    @endpoint
    def send_weights(self, version: int, reference: bool, generators: list[int]) -> dict[str, Any]:
        """Send this rank's pieces of the current weights as ``version`` to ``generators`` (their links).
        A link that fails is dropped and named in the reply; the others are not held up by it."""
        from stalwart.comm.weight_sync import send_weights

        t0 = time.perf_counter()
        try:
            if version != self.done:
                raise RuntimeError(f"trainer {self.rank} holds the weights of step {self.done}, not version {version}")
            links = [self.links[g] for g in generators]
            errors = send_weights(links, self.core.model.state_dict(), self.rank, version, reference,
                                  max(1, int(self.cfg.rl.weight_sync_bucket_mb * 2**20)))
        except BaseException:  # the links are dropped: the generators waiting on them fail at once
            for g in generators:
                self.links.pop(g, None)
            raise
        failed = {generators[i]: e for i, e in errors.items()}
        for g in failed:
            self.links.pop(g, None)
        return {"rank": self.rank, "failed": failed, "send_s": time.perf_counter() - t0}

    # ------------------------------------------------------------------ recovery
    @endpoint
    def snapshot(self, step: int) -> dict[str, Any]:
        """Keep this rank's shard of the model and optimizer at RL step ``step`` (collective)."""
        size = self.snapshots.save(step, self.core.model, self.core.optimizer,
                                   {"done": self.done, "optimizer_steps": self.core.state.step})
        return {"rank": self.rank, "bytes": size}

    @endpoint
    def restore(self, step: int | None = None) -> dict[str, Any]:
        """Load the snapshot of ``step``, by default the newest every rank can get (collective); its RL
        step. The snapshots outlive the processes (tmpfs): a rerun of a killed controller loads them too."""
        step = self.snapshots.newest_complete_step() if step is None else step
        if step is None:
            raise RuntimeError("no trainer snapshot is complete on every rank: the run cannot recover")
        state = self.snapshots.load(step, self.core.model, self.core.optimizer)
        self._at(int(state["done"]), int(state["optimizer_steps"]))
        return {"rank": self.rank, "step": self.done}

    def _manager(self, root: str):
        from stalwart.checkpoint.manager import CheckpointManager
        from stalwart.config.job import CheckpointConfig

        return CheckpointManager(Path(root), CheckpointConfig(async_save=False, keep_last=1), self.rank, self.world,
                                 lambda *a, **k: None)

    @endpoint
    def save_checkpoint(self, root: str) -> str:
        """A checkpoint of the model and optimizer in Stalwart's checkpoint format under ``root``, each rank
        writing its own shards (collective); returns its path. The trained policy is one; so is the state
        that crosses a change of the trainer count."""
        path = self._manager(root).save(self.done, self.core.model, self.core.optimizer,
                                        {"tokens_seen": 0, "optimizer_steps": self.core.state.step}, block=True)
        return str(path)

    @endpoint
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Load a ``save_checkpoint`` into this group's layout (collective; resharded as needed)."""
        loaded = self._manager(str(Path(path).parent)).load(Path(path), self.core.model, self.core.optimizer)
        self._at(int(loaded.trainer_state["step"]), int(loaded.trainer_state["optimizer_steps"]))
        return {"rank": self.rank, "step": self.done}

    def _at(self, done: int, optimizer_steps: int) -> None:
        """Restored state: ``done`` RL steps, ``optimizer_steps`` optimizer steps (the learning-rate schedule's
        position too: the RL core's schedule advances once per optimizer step)."""
        self.done = done
        self.core.state.step = optimizer_steps
        self.core.schedule.load_state_dict({"step_count": optimizer_steps})

    @endpoint
    def leave(self) -> None:
        from stalwart.runtime.group import leave

        self.links = {}
        if self.snapshots is not None:
            self.snapshots.clear()
        leave()
