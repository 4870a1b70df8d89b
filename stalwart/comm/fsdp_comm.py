"""FSDP2 hooks that route its gradient reduce-scatter and parameter all-gather through the
topology-aware algorithms (`FSDPModule.set_custom_reduce_scatter` / `set_custom_all_gather`).

FSDP2 pads every flat buffer to a multiple of the group size, so the equal-chunk layout it expects is
exactly `chunk_bounds(n, p)` of our collectives. Reductions other than SUM/AVG/MAX (e.g. NCCL's
pre-multiplied sum) fall back to the process group's built-in collective.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from stalwart.comm.selector import Selector

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max"}


class _Alloc:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class SelectorReduceScatter(_Alloc, ReduceScatter):
    def __init__(self, selector: Selector) -> None:
        self.selector = selector

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        name = _OPS.get(op) if isinstance(op, dist.ReduceOp.RedOpType) else None
        if name is None or input_tensor.device.type != "cpu":
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        output_tensor.copy_(self.selector.reduce_scatter(input_tensor, group, name).view_as(output_tensor))
        return None


class SelectorAllGather(_Alloc, AllGather):
    def __init__(self, selector: Selector) -> None:
        self.selector = selector

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if input_tensor.device.type != "cpu":
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        out = self.selector.all_gather(input_tensor.reshape(-1), output_tensor.numel(), group)
        output_tensor.copy_(out.view_as(output_tensor))
        return None


def install_on_fsdp(modules: list[torch.nn.Module], selector: Selector) -> int:
    """Install the hooks on every FSDP module in ``modules`` (and their submodules); returns how many."""
    from torch.distributed.fsdp import FSDPModule

    rs, ag = SelectorReduceScatter(selector), SelectorAllGather(selector)
    count = 0
    for root in modules:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(rs)
                m.set_custom_all_gather(ag)
                count += 1
    return count
