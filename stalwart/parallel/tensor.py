"""Tensor parallelism with sequence parallelism (Megatron-style) via DTensor plans.

Between blocks the residual stream is sharded along the sequence (``Shard(1)``); norms run on the
shard (SequenceParallel); attention and MLP all-gather their input, run column-parallel projections
(heads / hidden units split across ranks), and reduce-scatter the row-parallel output back to
sequence shards. The output head stays vocabulary-sharded when loss parallelism is on, so the
cross-entropy never materialises full logits on one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
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
    row-parallel output is all-reduced instead of reduce-scattered. Its modules then compute on their
    local shards with explicit collectives (:class:`LocalShard`), their parameters still DTensors.
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


def _parallelize_ends(model: nn.Module, tp_mesh, top: dict[str, object], src_data_rank: int | None = 0) -> None:
    """Apply the embedding/norm/head plan; keep a tied head tied."""
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    if top:
        parallelize_module(model, tp_mesh, top, src_data_rank=src_data_rank)
    if tied:
        # Both sides shard the vocabulary dimension (Shard(0)): re-tie to one DTensor parameter.
        model.output.weight = model.tok_embeddings.weight


def _apply_replicated_stream(model: nn.Module, tp_mesh) -> None:
    plans: list[tuple[nn.Module, dict[str, object]]] = []
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.output is not None:
        top["output"] = ColwiseParallel(output_layouts=Replicate())
    # NOTE: no collective while laying out (src_data_rank=None: each rank keeps its own split of what it
    # holds): this form's weights are always copied in afterwards (a checkpoint, a weight sync), and a
    # serving rank started again alone lays its model out while the others serve.
    _parallelize_ends(model, tp_mesh, top, src_data_rank=None)
    plans.append((model, top))
    for block in model.layers.values():
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel()}
        if block.moe is None:  # a sparse block runs whole on every rank, on its plain (replicated) weights
            plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                         "feed_forward.w2": RowwiseParallel()})
        parallelize_module(block, tp_mesh, plan, src_data_rank=None)
        plans.append((block, plan))
    group = tp_mesh.get_group()
    for root, plan in plans:
        for path, style in plan.items():
            parent, _, name = path.rpartition(".")
            owner = root.get_submodule(parent) if parent else root
            setattr(owner, name, LocalShard(getattr(owner, name), style, group))


class LocalShard(nn.Module):
    """A linear or embedding of the replicated-stream plan computed on this rank's shard, Megatron-style:
    the plan's parameter stays (a DTensor: loading and weight syncs read its placements), the forward
    runs on its local tensor with no DTensor dispatch. A column-parallel output stays this rank's slice
    (the next row-parallel product consumes it), a row-parallel product (or vocabulary-split embedding
    lookup) is summed by one all-reduce over ``group``, and a replicated column-parallel output (the
    head) is all-gathered. The same collectives, on the same local products, as the DTensor hooks
    the plan installs run, which this module replaces: DTensor's per-operator sharding propagation
    costs more than the product on small steps, and its cache misses at every new token count.
    """

    def __init__(self, module: nn.Module, style: object, group) -> None:
        super().__init__()
        self.weight = module.weight  # the same parameter object (a tied head stays tied)
        self.group = group
        self.ranks = dist.get_world_size(group)
        self.reduce = isinstance(style, RowwiseParallel)
        self.gather = isinstance(style, ColwiseParallel) and isinstance(style.output_layouts[0], Replicate)
        self.lookup = isinstance(module, nn.Embedding)
        if self.lookup:  # the rows of the vocabulary this rank holds
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            w = self.weight
            shape, offsets = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
            self.first, self.rows = offsets[0], shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight._local_tensor
        if self.lookup:  # ids outside this rank's rows look up row 0 and are zeroed
            outside = (x < self.first) | (x >= self.first + self.rows)
            y = F.embedding((x - self.first).masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            y = F.linear(x, w)
        if self.reduce:
            dist.all_reduce(y, group=self.group)
        elif self.gather:  # (..., vocab): each rank's columns, the last shards of an uneven split padded
            width = -(-self.weight.shape[0] // self.ranks)
            y = F.pad(y, (0, width - y.shape[-1])).contiguous()
            parts = [torch.empty_like(y) for _ in range(self.ranks)]
            dist.all_gather(parts, y, group=self.group)
            y = torch.cat(parts, dim=-1)[..., :self.weight.shape[0]]
        return y
