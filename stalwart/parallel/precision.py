"""Mixed precision where FSDP does not do the casting (one process, or replicas under DDP).

FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` keeps fp32 master weights,
runs forward and backward on bf16 copies and hands fp32 gradients to the optimizer. Without FSDP the
same policy is applied here: each unit of the model (a transformer block, and each other child of the
root: embedding, final norm, output head) has its parameters replaced by bf16 copies while it runs
(forward pre-hook) and restored when it returns (forward hook, also on an exception). Autograd carries
the gradients back through the casts to the fp32 parameters; the model itself is unchanged.

Why per unit and not once per call: a cast made where its unit runs is where autograd schedules its
backward, right after that unit's backward, so each fp32 gradient is complete there (DDP's bucket
all-reduce starts behind it); casts made up front all finish at the very end of backward. And a block
recomputed under activation checkpointing (the hooks sit on the block inside the checkpoint wrapper)
casts again when it is recomputed, so the recomputation sees the same dtypes as the forward did.
"""

from __future__ import annotations

import torch
from torch import nn


class _CastUnit:
    """Swap a unit's parameters for ``dtype`` copies for the duration of its forward."""

    def __init__(self, unit: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.slots = [(mod, name) for mod in unit.modules() for name, p in mod._parameters.items() if p is not None]
        self.saved: list[list[torch.Tensor]] = []

    def enter(self, _module, _args) -> None:
        saved = [mod._parameters[name] for mod, name in self.slots]
        for (mod, name), p in zip(self.slots, saved):
            # Assigned in the dict directly, as torch.func.functional_call does (setattr refuses a
            # plain tensor where a Parameter was), so the parameter order never changes.
            mod._parameters[name] = p.to(self.dtype)
        self.saved.append(saved)

    def leave(self, _module, _args, _output) -> None:
        for (mod, name), p in zip(self.slots, self.saved.pop()):
            mod._parameters[name] = p


def cast_units(model: nn.Module) -> list[nn.Module]:
    """The modules cast as one: each block (the module inside an activation-checkpoint wrapper) and
    each other child of the root that holds parameters."""
    if any(p is not None for p in model._parameters.values()):
        raise ValueError("mixed precision by cast: the root module holds parameters of its own")
    units = []
    for name, child in model.named_children():
        if name == "layers":
            units += [getattr(block, "_checkpoint_wrapped_module", block) for block in child.values()]
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


def apply_cast(model: nn.Module, dtype: torch.dtype) -> None:
    """Run ``model`` with its parameters cast to ``dtype`` unit by unit (see the module docstring)."""
    for unit in cast_units(model):
        cast = _CastUnit(unit, dtype)
        unit.register_forward_pre_hook(cast.enter)
        unit.register_forward_hook(cast.leave, always_call=True)
