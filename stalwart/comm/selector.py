"""Pick the predicted-fastest algorithm per (collective, message size, group) and run it.

The :class:`Selector` is the object the trainer holds: ``selector.all_reduce(t, group, op)``. It asks
the cost model for every candidate (the process group's built-in collective included, so a custom
algorithm is chosen only where it is predicted faster) and caches the choice per power-of-two size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stalwart.comm import collectives as coll
from stalwart.comm.cost import predict
from stalwart.comm.topology import Placement, Topology, detect_placement, load_topology
from stalwart.config.job import CommConfig


class Selector:
    """Chooses and runs collective algorithms for groups placed on ``topology``.

    ``placement`` maps global ranks to hosts (default: the topology's block placement of the world);
    ``fixed`` forces an algorithm per collective, e.g. ``{"all_reduce": "ring"}``.
    """

    def __init__(self, topology: Topology, placement: Placement | None = None,
                 fixed: dict[str, str] | None = None, candidates: dict[str, tuple[str, ...]] | None = None):
        self.topology = topology
        self._placement = placement
        self.fixed = dict(fixed or {})
        self.candidates = candidates or coll.ALGORITHMS
        self._cache: dict[tuple, str] = {}

    def placement(self, world_size: int) -> Placement:
        if self._placement is None or self._placement.world_size != world_size:
            self._placement = self.topology.place(world_size)
        return self._placement

    def predictions(self, op: str, nbytes: int, members: list[int], world_size: int | None = None) -> dict[str, float]:
        """Predicted seconds of every candidate algorithm."""
        pl = self.placement(world_size or (max(members) + 1))
        return {a: predict(op, a, members, nbytes, self.topology, pl) for a in self.candidates[op]}

    def choose(self, op: str, nbytes: int, members: list[int], world_size: int | None = None) -> str:
        if op in self.fixed:
            return self.fixed[op]
        key = (op, 1 << max(0, int(nbytes) - 1).bit_length(), tuple(members))
        if key not in self._cache:
            pred = self.predictions(op, key[1], members, world_size)
            self._cache[key] = min(pred, key=pred.__getitem__)
        return self._cache[key]

    # -- running --------------------------------------------------------------------------------
    def _members(self, group: dist.ProcessGroup | None) -> list[int]:
        return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                   op: object = "sum") -> torch.Tensor:
        members = self._members(group)
        algo = self.choose("all_reduce", tensor.numel() * tensor.element_size(), members, dist.get_world_size())
        return coll.all_reduce(tensor, group, op, algo, self.placement(dist.get_world_size()))

    def reduce_scatter(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                       op: object = "sum") -> torch.Tensor:
        members = self._members(group)
        algo = self.choose("reduce_scatter", tensor.numel() * tensor.element_size(), members, dist.get_world_size())
        return coll.reduce_scatter(tensor, group, op, algo, self.placement(dist.get_world_size()))

    def all_gather(self, shard: torch.Tensor, numel: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        members = self._members(group)
        algo = self.choose("all_gather", numel * shard.element_size(), members, dist.get_world_size())
        return coll.all_gather(shard, numel, group, algo, self.placement(dist.get_world_size()))


def build_selector(cfg: CommConfig, group: dist.ProcessGroup | None = None) -> Selector | None:
    """The selector for ``cfg`` (None for 'builtin'). Collective on ``group`` when placement is 'detect'."""
    if cfg.algorithm == "builtin":
        return None
    topo = load_topology(cfg.topology) if cfg.topology else Topology(name="default")
    placement = detect_placement(group) if cfg.placement == "detect" else None
    fixed = {} if cfg.algorithm == "auto" else {"all_reduce": cfg.algorithm}
    return Selector(topo, placement, fixed=fixed)
