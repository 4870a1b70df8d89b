"""Activation checkpointing per transformer block: full, or selective (op-level).

'full' recomputes the whole block in backward. 'selective' saves the outputs of the expensive ops
(matmuls and attention) and recomputes only the cheap ones (norms, activations, RoPE): most of the
memory saving of recomputation for a fraction of its compute.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}
if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
    _SAVE.add(torch.ops.aten._scaled_dot_product_cudnn_attention.default)


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    for name, block in list(model.layers.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False,
                                         context_fn=partial(create_selective_checkpoint_contexts, _policy))
        model.layers[name] = wrapped


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block in place (parameter names are unchanged)."""
    for block in model.layers.values():
        block.compile(fullgraph=False)
