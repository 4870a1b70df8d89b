"""Pipeline parallelism: split the single-device model by layers and build a schedule.

A stage is the model with the layers it does not own removed (embedding only on the first stage,
final norm and head only on the last). A rank may own several stages (interleaved / V schedules);
its stages share modules with one *rank container* that holds exactly the parameters this rank owns
under their original names, which is what the optimizer and the checkpoint see.
"""

from __future__ import annotations

import copy
import torch
from torch import nn

from stalwart.parallel.parts import ParallelModel

# name -> (schedule class name in torch.distributed.pipelining, stages per rank, V-shaped placement)
SCHEDULES: dict[str, tuple[str, int, bool]] = {
    "gpipe": ("ScheduleGPipe", 1, False),
    "1f1b": ("Schedule1F1B", 1, False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, False),
    "looped_bfs": ("ScheduleLoopedBFS", 2, False),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2, False),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", 2, True),
    "dualpipe_v": ("ScheduleDualPipeV", 2, True),
}


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    _, default, v_shape = SCHEDULES[schedule]
    if default == 1:
        return 1
    return 2 if v_shape else max(2, virtual_stages)


def stage_ids(pp_rank: int, pp: int, schedule: str, virtual_stages: int) -> list[int]:
    """Stage indices owned by ``pp_rank``: looped (r, r+pp, ...) or V-shaped (r, 2pp-1-r)."""
    n = stages_per_rank(schedule, virtual_stages)
    if SCHEDULES[schedule][2]:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(n)]


def split_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Contiguous, balanced layer ranges per stage (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def split_model(model: nn.Module, pp_rank: int, pp: int, schedule: str, virtual_stages: int) -> ParallelModel:
    """Cut ``model`` (on the meta device) into this rank's stages."""
    n_stages = pp * stages_per_rank(schedule, virtual_stages)
    owned = stage_ids(pp_rank, pp, schedule, virtual_stages)
    layout = split_layers(len(model.layers), n_stages)
    keep = {str(i) for s in owned for i in layout[s]}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if 0 not in owned:
        model.tok_embeddings = None
    if n_stages - 1 not in owned:
        model.norm = None
        model.output = None
    stages = []
    for s in owned:
        stage = copy.copy(model)  # shares submodules and buffers with the container
        stage._modules = dict(model._modules)
        stage._parameters = dict(model._parameters)
        stage._buffers = dict(model._buffers)
        stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layout[s]})
        if s != 0:
            stage.tok_embeddings = None
        if s != n_stages - 1:
            stage.norm = None
            stage.output = None
        stages.append(stage)
    return ParallelModel(container=model, stages=stages, stage_indices=owned, n_stages=n_stages)


def _stage_class():
    from torch.distributed.pipelining import PipelineStage

    from stalwart.models.moe import moe_modules

    class Stage(PipelineStage):
        """A stage whose metadata-inference forward (on empty tensors, before the first step's real
        micro-batches) leaves the sparse layers' routing statistics as they were."""

        def _compute_outputs(self, *args, module, **kwargs):
            saved = [(m, m.stat_tokens.clone(), m.stat_misc.clone()) for m in moe_modules(module).values()]
            try:
                return super()._compute_outputs(*args, module=module, **kwargs)
            finally:
                for m, tokens, misc in saved:
                    m.stat_tokens.copy_(tokens)
                    m.stat_misc.copy_(misc)

    return Stage


def build_schedule(parts: ParallelModel, pp_group, device: torch.device, schedule: str, n_microbatches: int,
                   loss_fn):
    from torch.distributed import pipelining

    cls = getattr(pipelining.schedules, SCHEDULES[schedule][0])
    stage_cls = _stage_class()
    stages = [stage_cls(m, s, parts.n_stages, device, group=pp_group)
              for m, s in zip(parts.stages, parts.stage_indices)]
    if SCHEDULES[schedule][1] == 1:
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
