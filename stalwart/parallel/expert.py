"""Expert parallelism: the routed experts of every sparse layer split over the ``ep`` ranks.

Each rank owns ``experts / ep`` consecutive experts (its ``Shard(0)`` slice of the stacked expert
weights). Its tokens, already sorted by expert by the model, travel to the ranks that own their experts
and back with two uneven all-to-alls per layer (``dispatch`` before the expert computation, ``combine``
after it), installed as input/output hooks on the experts module, so the model's forward is unchanged:

    counts (experts,)  --all_to_all-->  counts each source rank sends to my experts
    tokens sorted by expert  --all_to_all (uneven splits)-->  (source rank, my expert) blocks
    permute to (my expert, source rank) blocks -> grouped expert compute -> permute back
    --all_to_all (splits swapped)-->  results in the order the tokens left

The backward pass of each all-to-all is the all-to-all with the splits swapped. The ep ranks are the
inner part of dp_shard (they see different data), so an expert's gradient sums the contributions of
every ep rank's tokens; the experts are then FSDP-sharded over the remaining dp_shard ranks with the
gradient divided by the whole data-parallel size (see ``apply_fsdp``).

NOTE: dispatch and combine block the computation (no overlap with the shared experts or attention);
the time spent in them is measured per step (``ExpertComm.seconds``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from stalwart.models.moe import moe_modules


class ExpertComm:
    """Wall-clock seconds spent in the expert all-to-alls (forward and backward) since the last reset."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


class _AllToAll(torch.autograd.Function):
    """Differentiable uneven all-to-all of rows: rank r sends ``in_splits[j]`` rows to rank j."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, clock: ExpertComm):
        ctx.splits, ctx.group, ctx.clock = (out_splits, in_splits), group, clock
        return _all_to_all(x, out_splits, in_splits, group, clock)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group, ctx.clock), None, None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, clock: ExpertComm):
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    clock.seconds += time.perf_counter() - t0
    clock.calls += 1
    return out


def block_permutation(sizes: torch.Tensor) -> torch.Tensor:
    """Rows arrive in (source rank, expert) blocks of ``sizes`` (ep, local_experts); the index that
    reorders them into (expert, source rank) blocks: ``x[perm]`` is grouped by expert."""
    flat = sizes.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(sizes)
    seg_sizes, seg_starts = sizes.t().flatten(), starts.t().flatten()  # expert-major segments
    out_starts = torch.cumsum(seg_sizes, 0) - seg_sizes
    total = int(flat.sum())
    return torch.arange(total, device=sizes.device) + torch.repeat_interleave(seg_starts - out_starts, seg_sizes)


class _Dispatcher:
    """The dispatch (input) and combine (output) hooks of one experts module; holds the splits between."""

    def __init__(self, group, ep: int, clock: ExpertComm) -> None:
        self.group, self.ep, self.clock = group, ep, clock
        self.pending: list[tuple[list[int], list[int], torch.Tensor]] = []

    def dispatch(self, module: nn.Module, inputs, mesh):
        x, counts = inputs  # x: (tokens, dim) sorted by global expert; counts: (experts,)
        received = torch.empty_like(counts)
        t0 = time.perf_counter()
        dist.all_to_all_single(received, counts.contiguous(), group=self.group)  # equal splits of experts/ep
        self.clock.seconds += time.perf_counter() - t0
        sizes = received.view(self.ep, -1)  # (source rank, my expert)
        in_splits = counts.view(self.ep, -1).sum(1).tolist()
        out_splits = sizes.sum(1).tolist()
        rows = _AllToAll.apply(x, out_splits, in_splits, self.group, self.clock)
        perm = block_permutation(sizes)
        self.pending.append((out_splits, in_splits, perm))
        return rows[perm], sizes.sum(0)

    def combine(self, module: nn.Module, out: torch.Tensor, mesh):
        out_splits, in_splits, perm = self.pending.pop()
        back = torch.empty_like(out)
        back[perm] = out
        return _AllToAll.apply(back, in_splits, out_splits, self.group, self.clock)


def _shard_experts(name: str, module: nn.Module, mesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))


def apply_expert_parallel(model: nn.Module, ep_mesh) -> ExpertComm:
    """Shard the routed experts of every sparse layer of ``model`` (or a stage of it) over ``ep_mesh``."""
    clock = ExpertComm()
    group, ep = ep_mesh.get_group(), ep_mesh.size()
    for moe in moe_modules(model).values():
        d = _Dispatcher(group, ep, clock)
        distribute_module(moe.experts, ep_mesh, _shard_experts, input_fn=d.dispatch, output_fn=d.combine)
    return clock
