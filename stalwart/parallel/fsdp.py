"""FSDP2 (`fully_shard`) and HSDP: shard each transformer block, then the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, mesh, param_dtype: torch.dtype, reshard_after_forward: bool,
               expert_mesh=None, dp_size: int = 1) -> None:
    """Shard ``model`` over ``mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP).

    Parameters stay fp32 (the master copy); with ``param_dtype=bfloat16`` they are gathered and
    computed in bf16 while gradients are reduced in fp32.

    Under expert parallelism the routed experts (already ``Shard(0)`` over the ep ranks) are sharded
    separately over ``expert_mesh``, the dp_shard ranks outside their ep group. Their gradient already
    sums the tokens of every ep rank (through the all-to-all's backward), so it is divided by the
    whole data-parallel size ``dp_size`` rather than by the expert mesh's size.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layers = list(model.layers.values())
    for i, block in enumerate(layers):
        # The last block's parameters are needed again at the start of backward: keep them gathered.
        reshard = reshard_after_forward and i < len(layers) - 1
        moe = getattr(block, "moe", None)
        if expert_mesh is not None and moe is not None:
            fully_shard(moe.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard)
            moe.experts.set_gradient_divide_factor(float(dp_size))
            if expert_mesh.size() > 1:
                # Sum, then divide (gloo has no PREMUL_SUM). NOTE: not on a 1-rank mesh, where torch 2.13
                # would divide twice (once in place of the reduce-scatter and once after it).
                moe.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
