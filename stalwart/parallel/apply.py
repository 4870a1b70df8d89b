"""The one place where parallelism is applied, in one documented order.

    1. pipeline split   (a stage = the model with the layers it does not own removed)
    2. tensor + sequence parallel
    3. context parallel (ring attention)
    4. activation checkpointing
    5. torch.compile per block
    6. FSDP / HSDP      (last: it wraps whatever the earlier steps produced)

Each step lives in its own module; this file only decides whether and in which order they run.
"""

from __future__ import annotations

import torch
from torch import nn

from stalwart.parallel.dims import ParallelDims
from stalwart.parallel.fsdp import apply_fsdp


def parallelize(model: nn.Module, dims: ParallelDims, mesh, cfg, param_dtype: torch.dtype) -> nn.Module:
    """Apply the configured techniques to ``model`` (on the meta device). ``cfg``: parallelism section."""
    unsupported = [name for name in ("tp", "pp", "cp") if getattr(dims, name) > 1]
    if unsupported:
        from stalwart.parallel.dims import LayoutError

        raise LayoutError(f"parallelism: {', '.join(unsupported)} > 1 is not available in this build yet; "
                          "use data parallelism (dp_shard / dp_replicate)")
    if mesh is not None and (dims.world_size > 1 or param_dtype != torch.float32):
        apply_fsdp(model, mesh.fsdp, param_dtype, cfg.reshard_after_forward)
    return model
