"""Forward/backward of one optimizer step, whatever the layout.

The trainer hands over this rank's micro-batches; this module knows how they flow: straight through
the model (gradient accumulation), or through a pipeline schedule; with sequences cut into
context-parallel shards; with the cross-entropy computed on vocabulary-sharded logits under tensor
parallelism (loss parallel). It returns the rank's mean loss for logging.

The loss is a function ``loss_fn(logits, targets) -> scalar`` (default: next-token cross-entropy);
a caller with another objective (a policy-gradient loss) passes its own per call. ``targets`` is
whatever the batch carries in that slot, split into micro-batches along the first dimension.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from stalwart.data.loader import Batch
from stalwart.models.moe import set_aux_grad_scale
from stalwart.parallel.parts import ParallelModel
from stalwart.parallel.dims import Meshes, ParallelDims


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _forward(model: torch.nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None,
             batch: Batch) -> torch.Tensor:
    """The model on one micro-batch, replaying the experts the batch carries (``Batch.routing``)."""
    if batch.routing is None:
        return model(inputs, positions)
    return model(inputs, positions, routing=batch.routing)


class StepRunner:
    def __init__(self, pm: ParallelModel, dims: ParallelDims, meshes: Meshes | None, device: torch.device,
                 rank: int, n_microbatches: int, schedule_name: str, timer=None) -> None:
        from stalwart.observe import PhaseTimer

        self.pm, self.dims, self.device = pm, dims, device
        self.timer = timer if timer is not None else PhaseTimer(enabled=False)
        self.cp_rank = dims.coordinates(rank)["cp"]
        self.pp_rank = dims.coordinates(rank)["pp"]
        self.schedule = None
        if dims.pp > 1:
            from stalwart.parallel.pipeline import build_schedule, stages_per_rank

            self.pp_group = meshes["pp"].get_group()
            self.schedule_name = schedule_name
            self.virtual = len(pm.stage_indices) if stages_per_rank(schedule_name, 1) > 1 else 1
            # The schedule keeps the function it was built with; it calls the one of the current step.
            self.schedule = build_schedule(pm, self.pp_group, device, schedule_name, n_microbatches,
                                           loss_fn=lambda out, tgt: self._loss_fn(out, tgt))
        self._loss_fn: LossFn = cross_entropy
        self.objective: LossFn = cross_entropy  # the run's own loss (training.objective): the default of every step
        self.elastic = None  # a parallel.elastic.TreeAccumulator when training.elastic_exact is on
        self.elastic_group = None
        self.elastic_last: list[bool] | None = None  # FSDP's tree reduce-scatters: True for the last micro-batch
        self.params: list[torch.nn.Parameter] = []

    def use_elastic(self, accumulator, group, params: list[torch.nn.Parameter],
                    last: list[bool] | None = None) -> None:
        """Sum the micro-batches' gradients in the canonical tree of ``accumulator`` and exchange them over
        ``group`` (the data-parallel group; None on one process) instead of leaving it to DDP. ``last``:
        the model is FSDP-sharded and its reduce-scatters sum the gradients in the tree themselves
        (``parallel.elastic.apply_tree_reduce_scatter``); ``accumulator`` then sums only the losses."""
        self.elastic, self.elastic_group, self.params, self.elastic_last = accumulator, group, params, last

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

    def forward_backward(self, micro: list[Batch], loss_fn: LossFn | None = None) -> torch.Tensor | None:
        """Run forward and backward over this rank's micro-batches; return the mean loss, or None
        on a pipeline rank that does not hold the last stage. ``loss_fn``: default the run's objective."""
        loss_fn = loss_fn or self.objective
        self._loss_fn = loss_fn
        if (self.schedule is not None or self.dims.cp > 1) and any(b.routing is not None for b in micro):
            raise ValueError("routing replay runs without pipeline or context parallelism (pp = cp = 1)")
        if self.schedule is not None:
            return self._pipeline_step(micro)
        if self.elastic is not None:
            return self._elastic_step(micro, loss_fn)
        model = self.pm.stages[0]
        set_aux_grad_scale(model, 1.0 / len(micro))  # the balance loss's gradient, scaled like the loss's
        total = torch.zeros((), device=self.device)
        for batch in micro:
            inputs, targets, positions = self._prepare(batch)
            with self._loss_context():
                with self.timer.phase("forward"):
                    loss = loss_fn(_forward(model, inputs, positions, batch), targets)
                with self.timer.phase("backward"):
                    (loss / len(micro)).backward()
            total += _local(loss.detach())
        return total / len(micro)

    def _elastic_step(self, micro: list[Batch], loss_fn: LossFn) -> torch.Tensor:
        """Each micro-batch's gradient and loss into the world-size independent tree; the mean over the
        global batch lands in the gradients (the same on every rank) and is the returned loss."""
        from stalwart.parallel.elastic import assign_grads

        model = self.pm.stages[0]
        set_aux_grad_scale(model, 1.0)
        for i, batch in enumerate(micro):
            if self.elastic_last is None:
                self.elastic.push(self.leaf_value(batch, loss_fn))
                continue
            inputs, targets, positions = self._prepare(batch)
            with self.timer.phase("forward"):
                loss = loss_fn(_forward(model, inputs, positions, batch), targets)
            self.elastic_last[0] = i == len(micro) - 1
            with self.timer.phase("backward"):
                loss.backward()
            self.elastic.push(_local(loss.detach()).reshape(1).float())
        if self.elastic_last is not None:
            self.elastic_last[0] = False
            with self.timer.phase("reduce"):
                return self.elastic.total(self.elastic_group).div_(self.elastic.leaves)[0]
        with self.timer.phase("reduce"):
            total = self.elastic.total(self.elastic_group).div_(self.elastic.leaves)
        return assign_grads(self.params, total)[0]

    def leaf_value(self, batch: Batch, loss_fn: LossFn | None = None) -> torch.Tensor:
        """One micro-batch's gradient and loss as one flat vector (``training.elastic_exact`` with whole
        replicas): the value of one leaf of the canonical tree."""
        from stalwart.parallel.elastic import flat_grads

        model = self.pm.stages[0]
        inputs, targets, positions = self._prepare(batch)
        with self.timer.phase("forward"):
            loss = (loss_fn or self._loss_fn)(_forward(model, inputs, positions, batch), targets)
        with self.timer.phase("backward"):
            loss.backward()
        return flat_grads(self.params, _local(loss.detach()))

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
                    loss = self.objective(self.pm.stages[0](inputs, positions), targets)
                loss_sum += float(_local(loss)) * targets.numel()
                count += targets.numel()
            return loss_sum, count
        finally:
            for stage in self.pm.stages:
                stage.train()

    def _pipeline_eval(self, batches: list[Batch]) -> tuple[float, float]:
        """Forward-only pass through the stages in order, one micro-batch at a time.

        NOTE: deliberately not ``schedule.eval``: the V-shaped and zero-bubble schedules of torch 2.13
        cannot run forward-only. Evaluation is rare, so the simple sequential pass is fine.
        """
        import torch.distributed as dist

        from stalwart.parallel.pipeline import stage_ids

        group, pp, me = self.pp_group, self.dims.pp, self.pp_rank
        owner = {sid: r for r in range(pp) for sid in stage_ids(r, pp, self.schedule_name, self.virtual)}
        modules = dict(zip(self.pm.stage_indices, self.pm.stages))
        loss_sum, count = 0.0, 0.0
        for batch in batches:
            act = None
            for sid in range(self.pm.n_stages):
                if owner[sid] != me:
                    continue
                if sid == 0:
                    inp = batch.inputs.to(self.device)
                elif owner[sid - 1] == me:
                    inp = act
                else:
                    inp = _recv_tensor(dist.get_global_rank(group, owner[sid - 1]), group, self.device)
                out = modules[sid](inp)
                if sid == self.pm.n_stages - 1:
                    with self._loss_context():
                        loss = cross_entropy(out, batch.targets.to(self.device))
                    loss_sum += float(_local(loss)) * batch.targets.numel()
                    count += batch.targets.numel()
                elif owner[sid + 1] == me:
                    act = out
                else:
                    _send_tensor(out, dist.get_global_rank(group, owner[sid + 1]), group)
        return loss_sum, count


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _send_tensor(t: torch.Tensor, dst: int, group) -> None:
    import torch.distributed as dist

    t = t.detach().contiguous()
    header = torch.tensor([t.dim(), _DTYPES.index(t.dtype), *t.shape], dtype=torch.int64, device=t.device)
    size = torch.tensor([header.numel()], dtype=torch.int64, device=t.device)
    dist.send(size, dst, group=group)
    dist.send(header, dst, group=group)
    dist.send(t, dst, group=group)


def _recv_tensor(src: int, group, device) -> torch.Tensor:
    import torch.distributed as dist

    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, src, group=group)
    header = torch.empty(int(size), dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    shape = [int(x) for x in header[2:2 + int(header[0])]]
    out = torch.empty(shape, dtype=_DTYPES[int(header[1])], device=device)
    dist.recv(out, src, group=group)
    return out
