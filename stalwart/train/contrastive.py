"""The contrastive objective of an embeddings model: InfoNCE with in-batch negatives.

A pairs dataset (``stalwart data pairs``) gives each micro-batch as rows query 0, document 0,
query 1, document 1, ... and, in the targets' place, each row's text mask (``models.embedding``).
The loss pools each row into a unit vector and asks every query to pick its own document among the
micro-batch's documents (and every document its query): the symmetric cross-entropy of the cosine
similarities over a temperature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stalwart.errors import UserError
from stalwart.models.embedding import pool


class ObjectiveError(UserError):
    pass


def contrastive_loss(temperature: float):
    def loss(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        e = pool(out, mask)                                         # (2 * pairs, embed_dim)
        q, d = e[0::2], e[1::2]
        sim = q @ d.T / temperature                                 # (pairs, pairs)
        labels = torch.arange(sim.shape[0], device=sim.device)
        return 0.5 * (F.cross_entropy(sim, labels) + F.cross_entropy(sim.T, labels))
    return loss


def check_objective(training, model_args, pair_len: int, dims) -> None:
    """The objective, the model's head, the data's layout and the parallel layout agree (before any work)."""
    if training.objective == "contrastive":
        if not model_args.embed_dim:
            raise ObjectiveError("training.objective = contrastive trains an embeddings model: set --model.embed_dim "
                                 "(e.g. 128)")
        if not pair_len:
            raise ObjectiveError("training.objective = contrastive needs a pairs dataset as data.path (made by "
                                 "`stalwart data pairs`)")
        if training.micro_batch < 2:
            raise ObjectiveError("training.objective = contrastive needs training.micro_batch >= 2 (the other pairs "
                                 "of a micro-batch are each pair's negatives)")
        if dims.pp > 1 or dims.cp > 1 or dims.tp > 1:
            raise ObjectiveError("training.objective = contrastive runs with data parallelism (replicated or FSDP); "
                                 "set parallelism.tp, pp and cp to 1")
        return
    if model_args.embed_dim:
        raise ObjectiveError("model.embed_dim > 0 makes an embeddings model: train it with --training.objective "
                             "contrastive")
    if pair_len:
        raise ObjectiveError("data.path is a pairs dataset (for an embeddings model): train it with "
                             "--training.objective contrastive --model.embed_dim N")
