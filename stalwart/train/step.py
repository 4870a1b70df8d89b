"""Forward/backward of one optimizer step, whatever the layout.

The trainer hands over this rank's micro-batches; this module knows how they flow: straight through
the model (gradient accumulation), or through a pipeline schedule; with sequences cut into
context-parallel shards; with the cross-entropy computed on vocabulary-sharded logits under tensor
parallelism (loss parallel). It returns the rank's mean loss for logging.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from stalwart.data.loader import Batch
from stalwart.parallel.apply import ParallelModel
from stalwart.parallel.dims import Meshes, ParallelDims


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class StepRunner:
    def __init__(self, pm: ParallelModel, dims: ParallelDims, meshes: Meshes | None, device: torch.device,
                 rank: int, n_microbatches: int, schedule_name: str, timer=None) -> None:
        from stalwart.observe import PhaseTimer

        self.pm, self.dims, self.device = pm, dims, device
        self.timer = timer if timer is not None else PhaseTimer(enabled=False)
        self.cp_rank = dims.coordinates(rank)["cp"]
        self.schedule = None
        if dims.pp > 1:
            from stalwart.parallel.pipeline import build_schedule

            self.schedule = build_schedule(pm, meshes["pp"].get_group(), device, schedule_name, n_microbatches,
                                           loss_fn=cross_entropy)

    def _loss_context(self):
        if self.pm.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        inputs, targets = batch.inputs.to(self.device), batch.targets.to(self.device)
        if self.dims.cp == 1:
            return inputs, targets, None
        from stalwart.parallel.context import cp_positions, shard_sequence

        seq = inputs.shape[1]
        return (shard_sequence(inputs, self.cp_rank, self.dims.cp), shard_sequence(targets, self.cp_rank, self.dims.cp),
                cp_positions(seq, self.cp_rank, self.dims.cp, self.device))

    def forward_backward(self, micro: list[Batch]) -> torch.Tensor | None:
        """Run forward and backward over this rank's micro-batches; return the mean loss, or None
        on a pipeline rank that does not hold the last stage."""
        if self.schedule is not None:
            return self._pipeline_step(micro)
        model = self.pm.stages[0]
        total = torch.zeros((), device=self.device)
        for batch in micro:
            inputs, targets, positions = self._prepare(batch)
            with self._loss_context():
                with self.timer.phase("forward"):
                    loss = cross_entropy(model(inputs, positions), targets)
                with self.timer.phase("backward"):
                    (loss / len(micro)).backward()
            total += _local(loss.detach())
        return total / len(micro)

    def _pipeline_step(self, micro: list[Batch]) -> torch.Tensor | None:
        inputs = torch.cat([b.inputs for b in micro]).to(self.device)
        targets = torch.cat([b.targets for b in micro]).to(self.device)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.pm.has_first else ()
        with self._loss_context(), self.timer.phase("pipeline"):
            self.schedule.step(*args, target=targets if self.pm.has_last else None,
                               losses=losses if self.pm.has_last else None, return_outputs=False)
        if not self.pm.has_last:
            return None
        return torch.stack([_local(x.detach()) for x in losses]).mean()

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> tuple[float, float]:
        """(sum of token losses, number of tokens) over this rank's share of the validation set;
        (0, 0) on a pipeline rank without the last stage."""
        for stage in self.pm.stages:
            stage.eval()
        loss_sum, count = 0.0, 0.0
        try:
            if self.schedule is not None:
                return self._pipeline_eval(batches)
            for batch in batches:
                inputs, targets, positions = self._prepare(batch)
                with self._loss_context():
                    loss = cross_entropy(self.pm.stages[0](inputs, positions), targets)
                loss_sum += float(_local(loss)) * targets.numel()
                count += targets.numel()
            return loss_sum, count
        finally:
            for stage in self.pm.stages:
                stage.train()

    def _pipeline_eval(self, batches: list[Batch]) -> tuple[float, float]:
        n = self.schedule._n_microbatches
        loss_sum, count = 0.0, 0.0
        for start in range(0, len(batches) - n + 1, n):
            group = batches[start:start + n]
            inputs = torch.cat([b.inputs for b in group]).to(self.device)
            targets = torch.cat([b.targets for b in group]).to(self.device)
            losses: list[torch.Tensor] = []
            with self._loss_context():
                self.schedule.eval(*((inputs,) if self.pm.has_first else ()),
                                   target=targets if self.pm.has_last else None,
                                   losses=losses if self.pm.has_last else None, return_outputs=False)
            if self.pm.has_last:
                per = targets.numel() / n
                loss_sum += sum(float(_local(x)) for x in losses) * per
                count += targets.numel()
        return loss_sum, count
