"""What parallelization hands the trainer: this rank's share of the model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ParallelModel:
    """This rank's share of the model, ready to materialize.

    ``container`` holds every parameter this rank owns under its original name (optimizer,
    checkpoint, initialisation); ``stages`` are the modules that run forward (one, unless this rank
    owns several pipeline stages).
    """

    container: nn.Module
    stages: list[nn.Module]
    stage_indices: list[int] = field(default_factory=lambda: [0])
    n_stages: int = 1
    loss_parallel: bool = False
    custom_comm_modules: int = 0  # FSDP modules whose collectives use Stalwart's algorithms
    comm_thread: object = None  # comm/fsdp_comm.CommThread running them (None: built-in collectives)
    expert_comm: object = None  # ExpertComm: time in the expert all-to-alls (expert parallel only)
    replicated: bool = False  # data parallel by DDP's replicate (parallel/replicate.py): start it once real
    # Mixed precision without FSDP (no mesh, or DDP): the dtype parallel/precision.py casts each block to.
    cast_dtype: torch.dtype | None = None

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_indices
