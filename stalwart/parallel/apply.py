"""The one place where parallelism is applied, in one documented order.

    1. pipeline split   (a stage = the model with the layers it does not own removed)
    2. tensor + sequence parallel, then expert parallel (the routed experts over the ep ranks)
    3. context parallel (ring attention)
    4. activation checkpointing
    5. torch.compile per block
    6. FSDP / HSDP      (last: it wraps whatever the earlier steps produced); without a mesh,
                        mixed precision is a cast at call time (parallel/precision.py)

Each step lives in its own module; this file only decides whether and in which order they run.
"""

from __future__ import annotations

import torch
from torch import nn

from stalwart.parallel.dims import LayoutError, Meshes, ParallelDims
from stalwart.parallel.fsdp import apply_fsdp
from stalwart.parallel.parts import ParallelModel


def parallelize(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, cfg, param_dtype: torch.dtype,
                rank: int = 0, comm_cfg=None) -> ParallelModel:
    """Apply the configured techniques to ``model`` (on the meta device). ``cfg``: parallelism section;
    ``comm_cfg``: the comm section (which algorithms FSDP's collectives use)."""
    # 1. Pipeline split.
    if dims.pp > 1:
        from stalwart.parallel.pipeline import split_model

        if model.args.tie_embeddings:
            raise LayoutError("parallelism.pp > 1 needs untied embeddings (the embedding and the output head "
                              "live on different stages); set --model.tie_embeddings false")
        if dims.cp > 1:
            raise LayoutError("parallelism: pp > 1 together with cp > 1 is not supported; use one of them")
        pp_rank = dims.coordinates(rank)["pp"]
        pm = split_model(model, pp_rank, dims.pp, cfg.pp_schedule, cfg.pp_virtual_stages)
    else:
        pm = ParallelModel(model, [model])
    for stage in pm.stages:
        # 2. Tensor + sequence parallel.
        if dims.tp > 1:
            from stalwart.parallel.tensor import apply_tensor_parallel

            pm.loss_parallel = cfg.loss_parallel
            apply_tensor_parallel(stage, meshes["tp"], cfg.loss_parallel, replicate_experts=dims.ep == 1)
        if dims.ep > 1:
            from stalwart.parallel.expert import apply_expert_parallel

            pm.expert_comm = apply_expert_parallel(stage, meshes.ep)
        # 3. Context parallel.
        if dims.cp > 1:
            from stalwart.parallel.context import apply_context_parallel

            apply_context_parallel(stage, meshes["cp"].get_group())
        # 4-5. Activation checkpointing, compile.
        from stalwart.parallel.activation_checkpoint import apply_activation_checkpointing, apply_compile

        apply_activation_checkpointing(stage, cfg.activation_checkpoint)
        if cfg.compile:
            apply_compile(stage)
        # 6. FSDP / HSDP (on a 1-rank mesh too when mixed precision needs FSDP's casting policy).
        if meshes is not None and (meshes.fsdp.size() > 1 or param_dtype != torch.float32):
            apply_fsdp(stage, meshes.fsdp, param_dtype, cfg.reshard_after_forward and dims.pp == 1,
                       meshes.expert_fsdp, dims.dp)
    if meshes is None and param_dtype != torch.float32:
        # No FSDP to cast: the step runs the model through parallel/precision.py's cast, same policy.
        pm.cast_dtype = param_dtype
    if comm_cfg is not None and comm_cfg.algorithm != "builtin" and meshes is not None and meshes.fsdp.size() > 1:
        # FSDP's reduce-scatter / all-gather through the topology-aware algorithms.
        from stalwart.comm.fsdp_comm import install_on_fsdp
        from stalwart.comm.selector import build_selector

        shard_group = meshes.fsdp.get_group(meshes.fsdp.ndim - 1)
        pm.comm_thread = install_on_fsdp(pm.stages, build_selector(comm_cfg, shard_group), comm_cfg.overlap)
        pm.custom_comm_modules = pm.comm_thread.modules
    return pm
