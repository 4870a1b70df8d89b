"""Where this process stands in its job: rank, world, local rank and world, device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from stalwart.runtime.device import HOST


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @classmethod
    def single(cls, device: torch.device = HOST) -> "DistEnv":
        """One process, alone (or a rank that does not care about its peers' placement)."""
        return cls(0, 1, 0, 1, device)

    @classmethod
    def of(cls, rank: int, world: int, device: torch.device = HOST) -> "DistEnv":
        """A rank of a group whose processes all run on one host (actors, benchmark workers)."""
        return cls(rank, world, rank, world, device)

    @property
    def is_distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0
