"""The one place where parallelism is applied, in one documented order.

    1. pipeline split   (a stage = the model with the layers it does not own removed)
    2. tensor + sequence parallel, then expert parallel (the routed experts over the ep ranks)
    3. context parallel (ring attention)
    4. activation checkpointing
    5. torch.compile per block
    6. data parallel    (last: it wraps whatever the earlier steps produced): DDP's replicate when
                        every data-parallel rank holds the whole model and nothing else is split
                        (parallel/replicate.py), FSDP / HSDP otherwise; without FSDP, mixed
                        precision is a cast of each block as it runs (parallel/precision.py)

Each step lives in its own module; this file only decides whether and in which order they run.
"""

from __future__ import annotations

import torch
from torch import nn

from stalwart.parallel.dims import LayoutError, Meshes, ParallelDims, replicates_whole_model
from stalwart.parallel.fsdp import apply_fsdp
from stalwart.parallel.parts import ParallelModel


def parallelize(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, cfg, param_dtype: torch.dtype,
                comm_cfg, rank: int = 0, elastic: bool = False) -> ParallelModel:
    """Apply the configured techniques to ``model`` (on the meta device). ``cfg``: parallelism section;
    ``comm_cfg``: the comm section (DDP's bucket size; which algorithms the gradient collectives use).
    ``elastic``: the step reduces the gradients itself (``parallel/elastic.py``), so no DDP wrapper is
    applied to replicas; an FSDP-sharded model (``dp_shard > 1``) is still sharded, and the caller
    replaces its reduce-scatters (``apply_tree_reduce_scatter``)."""
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
    replicated = meshes is not None and replicates_whole_model(dims) and not elastic
    whole = elastic and dims.dp_shard == 1  # elastic replicas: each rank holds the whole, unwrapped model
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
        # 6. Data parallel: replicate (DDP), or FSDP / HSDP (on a 1-rank mesh too when mixed precision
        # needs FSDP's casting policy).
        if replicated:
            from stalwart.parallel.replicate import apply_replicate

            apply_replicate(stage, meshes.dp.get_group(), comm_cfg.bucket_mb)
            pm.replicated = True
        elif meshes is not None and not whole and (meshes.fsdp.size() > 1 or param_dtype != torch.float32):
            apply_fsdp(stage, meshes.fsdp, param_dtype, cfg.reshard_after_forward and dims.pp == 1,
                       meshes.expert_fsdp, dims.dp)
    if (meshes is None or replicated or whole) and param_dtype != torch.float32:
        # No FSDP to cast: parallel/precision.py casts each unit's parameters as it runs, same policy.
        from stalwart.parallel.precision import apply_cast

        for stage in pm.stages:
            apply_cast(stage, param_dtype)
        pm.cast_dtype = param_dtype
    custom = comm_cfg.algorithm != "builtin"
    if custom and replicated:
        # DDP's bucket all-reduce through the topology-aware algorithms, on the comm thread.
        from stalwart.comm.grads import install_on_replicate
        from stalwart.comm.selector import build_selector

        group = meshes.dp.get_group()
        pm.comm_thread = install_on_replicate(pm.stages, build_selector(comm_cfg, group), group, comm_cfg.overlap)
        pm.custom_comm_modules = pm.comm_thread.modules
    elif custom and meshes is not None and meshes.fsdp.size() > 1:
        # FSDP's reduce-scatter / all-gather through the topology-aware algorithms.
        from stalwart.comm.fsdp_comm import install_on_fsdp
        from stalwart.comm.selector import build_selector

        shard_group = meshes.fsdp.get_group(meshes.fsdp.ndim - 1)
        pm.comm_thread = install_on_fsdp(pm.stages, build_selector(comm_cfg, shard_group), comm_cfg.overlap)
        pm.custom_comm_modules = pm.comm_thread.modules
    return pm
