"""The ``[islands]`` section: training across sites joined by a slow link (``parallelism.islands``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stalwart.config.core import ConfigError, option


@dataclass
class IslandsConfig:
    algorithm: Literal["diloco", "streaming", "sync"] = option(
        "How the islands meet: 'diloco' (every island takes inner_steps optimizer steps on its own data, then "
        "they average their parameter change, the outer gradient, and apply it with Nesterov SGD), "
        "'streaming' (Streaming DiLoCo: the model in `fragments` parts, each synced on its own staggered "
        "schedule, the exchange overlapped with `overlap_steps` inner steps), 'sync' (synchronous data "
        "parallelism: every step's gradients are averaged across the islands; the baseline).", "diloco")
    inner_steps: int = option("H: optimizer steps each island takes between two syncs of a parameter.", 50, min=1)
    fragments: int = option("streaming: the model's blocks in this many fragments, synced H / fragments steps "
                            "apart (diloco: 1).", 4, min=1)
    overlap_steps: int = option("streaming: inner steps a fragment's exchange overlaps before its result is "
                                "applied (tau; 0 = wait for it).", 1, min=0)
    mixing: float = option("streaming: a fragment's parameters after its sync = mixing * local + (1 - mixing) * "
                           "global (0 = take the global; the overlapped inner steps are then dropped).", 0.5,
                           min=0.0, max=1.0)
    outer_lr: float = option("Outer Nesterov SGD learning rate (DiLoCo's 0.7).", 0.7, min=0.0)
    outer_momentum: float = option("Outer Nesterov momentum (DiLoCo's 0.9).", 0.9, min=0.0, max=0.999)
    quantize: Literal["none", "bf16", "int8", "int4"] = option(
        "Outer gradients on the link: float32 ('none'), bfloat16, or int8 / int4 with one scale per block of "
        "`block` values; the rounding error is carried into the next sync (error feedback).", "none")
    block: int = option("Values per quantization scale (int8/int4).", 256, min=8)
    sync_timeout_s: float = option("How long an island waits at a sync for the others (a lost island's "
                                   "restart included) before it fails.", 600.0, min=1.0)

    def validate(self, islands: int, steps: int) -> None:
        """Checks against the layout (``parallelism.islands``) and the run's length."""
        if islands < 2:
            return
        if self.algorithm == "streaming":
            if self.inner_steps % self.fragments:
                raise ConfigError(f"islands.inner_steps ({self.inner_steps}) must be a multiple of islands.fragments "
                                  f"({self.fragments}): fragments sync inner_steps / fragments steps apart")
            if self.overlap_steps >= self.inner_steps // self.fragments:
                raise ConfigError(f"islands.overlap_steps ({self.overlap_steps}) must be below the "
                                  f"{self.inner_steps // self.fragments} steps between two fragments' syncs")


def check_islands(cfg: IslandsConfig, parallelism, training, fault) -> None:
    """``parallelism.islands`` > 1 against the rest of the job (its sections, not the root config)."""
    k, t = parallelism.islands, training
    if fault.group_recovery:
        raise ConfigError("parallelism.islands and fault.group_recovery are two ways to split a job: an island "
                          "already restarts alone; drop --fault.group_recovery")
    if fault.replica_group >= k:
        raise ConfigError(f"fault.replica_group ({fault.replica_group}) must be below parallelism.islands "
                          f"({k}): islands are numbered from 0")
    if t.global_batch % (k * t.micro_batch):
        raise ConfigError(f"training.global_batch ({t.global_batch}) is the whole job's: it must split into "
                          f"{k} islands x whole micro-batches of {t.micro_batch}")
    cfg.validate(k, t.steps)
