"""Mixed precision where FSDP does not do the casting (one process, no device mesh).

FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` keeps fp32 master weights,
runs forward and backward on bf16 copies and hands fp32 gradients to the optimizer. Without a mesh
there is no FSDP, so the same policy is applied here: each call runs the module with its parameters
cast to the compute dtype (``torch.func.functional_call``); autograd carries the gradients back
through the cast to the fp32 parameters. The model itself stays unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call


def call_in_dtype(module: nn.Module, dtype: torch.dtype | None, *args):
    """``module(*args)``, computed with its parameters cast to ``dtype`` (None: as they are)."""
    if dtype is None:
        return module(*args)
    params = {name: p.to(dtype) for name, p in module.named_parameters()}
    return functional_call(module, params, args, tie_weights=True, strict=False)
