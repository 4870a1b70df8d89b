"""Public collective entry points: pick an algorithm by name, handle shapes, dtypes, AVG and groups.

``all_reduce(t, group, op, algorithm)`` works in place on any tensor; ``reduce_scatter`` and
``all_gather`` use the balanced split of a flat tensor of n elements over p ranks (rank i owns
``chunk_bounds(n, p)[i]``: the first n % p ranks one element more), so every n works, 0 included.
``"builtin"`` is the process group's own collective, for comparison.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stalwart.comm import algorithms as flat
from stalwart.comm import hierarchical as hier
from stalwart.comm.team import Team, as_op, chunk_bounds
from stalwart.comm.topology import Placement

ALL_REDUCE = ("ring", "rd", "rhd", "dbtree", "hier_ring", "hier_rd", "hier2d_ring", "hier2d_rhd", "builtin")
REDUCE_SCATTER = ("ring", "halving", "hier", "builtin")
ALL_GATHER = ("ring", "doubling", "hier", "builtin")
ALGORITHMS = {"all_reduce": ALL_REDUCE, "reduce_scatter": REDUCE_SCATTER, "all_gather": ALL_GATHER}

_BUILTIN_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


def _check(op_name: str, algorithm: str, placement: Placement | None) -> None:
    if algorithm not in ALGORITHMS[op_name]:
        raise ValueError(f"unknown {op_name} algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS[op_name])}")
    if algorithm.startswith("hier") and placement is None:
        raise ValueError(f"{op_name} algorithm {algorithm!r} needs a placement (which host each rank is on)")


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: object = "sum",
               algorithm: str = "ring", placement: Placement | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place with the named algorithm; returns ``tensor``."""
    name = as_op(op)
    _check("all_reduce", algorithm, placement)
    if algorithm == "builtin":
        dist.all_reduce(tensor, op=_BUILTIN_OP[name], group=group)
        return tensor
    team = Team.of(group)
    buf = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    reduce_op = "max" if name == "max" else "sum"
    if algorithm == "ring":
        flat.ring_all_reduce(team, buf, reduce_op)
    elif algorithm == "rd":
        flat.recursive_doubling_all_reduce(team, buf, reduce_op)
    elif algorithm == "rhd":
        flat.rabenseifner_all_reduce(team, buf, reduce_op)
    elif algorithm == "dbtree":
        flat.double_tree_all_reduce(team, buf, reduce_op)
    elif algorithm.startswith("hier2d_"):
        hier.hierarchical_2d_all_reduce(team, buf, reduce_op, placement, inter=algorithm.split("_", 1)[1])
    else:
        hier.hierarchical_all_reduce(team, buf, reduce_op, placement, inter=algorithm.split("_", 1)[1])
    if name == "avg":
        buf.div_(team.size)
    if buf.data_ptr() != tensor.data_ptr():
        tensor.copy_(buf.view_as(tensor))
    return tensor


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: object = "sum",
                   algorithm: str = "ring", placement: Placement | None = None) -> torch.Tensor:
    """Reduce the flattened ``tensor`` over ``group``; returns this rank's balanced chunk (a new tensor).

    The input is not modified.
    """
    name = as_op(op)
    _check("reduce_scatter", algorithm, placement)
    p = dist.get_world_size(group)
    me = dist.get_rank(group)
    bounds = chunk_bounds(tensor.numel(), p)
    off, n = bounds[me]
    buf = tensor.reshape(-1).clone()
    if algorithm == "builtin":
        # The built-in needs equal chunks: pad every rank's segment to the largest, then unpad.
        width = max(b[1] for b in bounds)
        padded = torch.zeros(p * width, dtype=buf.dtype)
        for r, (o, m) in enumerate(bounds):
            padded[r * width:r * width + m] = buf[o:o + m]
        out = torch.empty(width, dtype=buf.dtype)
        if width:
            dist.reduce_scatter_single(out, padded, op=_BUILTIN_OP[name], group=group)
        return out[:n].clone()
    team = Team.of(group)
    reduce_op = "max" if name == "max" else "sum"
    if algorithm == "ring":
        flat.ring_reduce_scatter(team, buf, bounds, reduce_op)
    elif algorithm == "halving":
        flat.halving_reduce_scatter(team, buf, bounds, reduce_op)
    else:
        hier.hierarchical_reduce_scatter(team, buf, bounds, reduce_op, placement)
    out = buf[off:off + n].clone()
    if name == "avg":
        out.div_(p)
    return out


def all_gather(shard: torch.Tensor, numel: int, group: dist.ProcessGroup | None = None,
               algorithm: str = "ring", placement: Placement | None = None) -> torch.Tensor:
    """Concatenate every rank's ``shard`` (rank i's has ``chunk_bounds(numel, p)[i]`` elements)."""
    _check("all_gather", algorithm, placement)
    p = dist.get_world_size(group)
    me = dist.get_rank(group)
    bounds = chunk_bounds(numel, p)
    if shard.numel() != bounds[me][1]:
        raise ValueError(f"rank {me}: shard has {shard.numel()} elements, expected {bounds[me][1]} of {numel}")
    buf = torch.empty(numel, dtype=shard.dtype)
    off, n = bounds[me]
    buf[off:off + n] = shard.reshape(-1)
    if algorithm == "builtin":
        width = max(b[1] for b in bounds)
        if width:
            mine = torch.zeros(width, dtype=shard.dtype)
            mine[:n] = shard.reshape(-1)
            padded = torch.empty(p * width, dtype=shard.dtype)
            dist.all_gather_single(padded, mine, group=group)
            for r, (o, m) in enumerate(bounds):
                buf[o:o + m] = padded[r * width:r * width + m]
        return buf
    team = Team.of(group)
    if algorithm == "ring":
        flat.ring_all_gather(team, buf, bounds)
    elif algorithm == "doubling":
        flat.doubling_all_gather(team, buf, bounds)
    else:
        hier.hierarchical_all_gather(team, buf, bounds, placement)
    return buf
