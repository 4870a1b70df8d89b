"""Tensor parallelism with sequence parallelism (Megatron-style) via DTensor plans.

Between blocks the residual stream is sharded along the sequence (``Shard(1)``); norms run on the
shard (SequenceParallel); attention and MLP all-gather their input, run column-parallel projections
(heads / hidden units split across ranks), and reduce-scatter the row-parallel output back to
sequence shards. The output head stays vocabulary-sharded when loss parallelism is on, so the
cross-entropy never materialises full logits on one rank.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def _replicate_params(module: nn.Module, mesh) -> None:
    """Every parameter under ``module`` a Replicate DTensor; buffers untouched (unlike distribute_module)."""
    for sub in module.modules():
        for pname, param in list(sub.named_parameters(recurse=False)):
            sub.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))


def apply_tensor_parallel(model: nn.Module, tp_mesh, loss_parallel: bool, replicate_experts: bool = True,
                          sequence_parallel: bool = True) -> None:
    """Shard ``model`` (or a pipeline stage of it) over the 1-D ``tp_mesh``. ``replicate_experts``: False
    when expert parallelism shards the routed experts instead.

    ``sequence_parallel=False`` is the inference plan: the residual stream stays replicated (its token
    count changes every step and need not divide the degree), norms run unsharded, and each block's
    row-parallel output is all-reduced instead of reduce-scattered.
    """
    if not sequence_parallel:
        return _apply_replicated_stream(model, tp_mesh)
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1),
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    _parallelize_ends(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        }
        if block.moe is None:
            plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
        else:
            # NOTE: the sparse feed-forward is not tensor-parallel: every tp rank routes and computes the
            # whole (gathered) sequence with plain replicated weights, then keeps its sequence shard.
            # Routing needs whole sequences (the balance statistics are per sequence).
            # Its weights become Replicate DTensors (one optimizer over DTensors; the block computes on
            # their local values), its buffers (routing bias, statistics) stay plain tensors.
            plan["moe"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
            parts = [block.moe.router] + ([block.moe.shared_experts] if block.moe.shared_experts else [])
            for part in parts + ([block.moe.experts] if replicate_experts else []):
                _replicate_params(part, tp_mesh)
        if block.ffn_norm is not None:
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)


def _parallelize_ends(model: nn.Module, tp_mesh, top: dict[str, object]) -> None:
    """Apply the embedding/norm/head plan; keep a tied head tied."""
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied:
        # Both sides shard the vocabulary dimension (Shard(0)): re-tie to one DTensor parameter.
        model.output.weight = model.tok_embeddings.weight


def _apply_replicated_stream(model: nn.Module, tp_mesh) -> None:
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.output is not None:
        top["output"] = ColwiseParallel(output_layouts=Replicate())
    _parallelize_ends(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel()}
        if block.moe is None:  # a sparse block runs whole on every rank, on its plain (replicated) weights
            plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                         "feed_forward.w2": RowwiseParallel()})
        parallelize_module(block, tp_mesh, plan)
