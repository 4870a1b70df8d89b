"""Debugging aids registered on the training core from outside the step (``debug`` section)."""

from __future__ import annotations

import torch

from stalwart.paths import RunPaths
from stalwart.train.init import canonical_name


class GradientDump:
    """A backward hook: write the full gradient of the named parameters for the first
    ``debug.dump_steps`` steps to ``<run>/debug/`` (safetensors), before clipping. One rank per
    pipeline stage writes (the one at coordinate 0 of every other dimension)."""

    def __init__(self, cfg, paths: RunPaths, core, rank: int) -> None:
        self.names, self.steps = set(cfg.dump_grads), cfg.dump_steps
        self.paths, self.core = paths, core
        coords = core.dims.coordinates(rank)
        self.writer = all(coords[d] == 0 for d in ("dp_replicate", "dp_shard", "cp", "tp"))

    def __call__(self, step: int, local_loss: torch.Tensor | None) -> torch.Tensor | None:
        if step > self.steps:
            return local_loss
        from safetensors.torch import save_file

        for name, param in self.core.model.named_parameters():
            name = canonical_name(name)
            if name not in self.names or param.grad is None:
                continue
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad  # collective
            if self.writer:
                self.paths.debug_dir.mkdir(parents=True, exist_ok=True)
                save_file({"grad": grad.detach().float().cpu().contiguous()}, str(self.paths.grad_dump(step, name)))
        return local_loss
