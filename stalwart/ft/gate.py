"""The contract between the optimizer wrapper and whoever decides whether a step's update is applied.

The training core's :class:`~stalwart.train.optim.GatedOptimizer` hands each gate a
:class:`StepOutcome` just before the update; each gate answers with a :class:`Decision`. The step
commits only if every gate agrees (torchft's pattern: the wrapper decides whether a step commits, the
loop does not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class StepOutcome:
    """What a rank knows about its step when the update is about to be applied."""

    step: int
    local_loss: torch.Tensor | None   # None on a pipeline rank without the last stage
    grad_norm: float                  # global (all shards and stages)
    compute_s: float                  # this rank's step time up to the end of backward (before any
                                      # collective of the update): what tells a straggler apart


@dataclass
class Decision:
    commit: bool = True
    mean_loss: float | None = None    # the loss averaged over ranks, when a gate already gathered it


Gate = Callable[[StepOutcome], Decision]
