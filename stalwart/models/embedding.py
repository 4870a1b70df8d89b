"""How an embeddings model (``TransformerArgs.embed_dim > 0``) turns its per-position outputs into one
vector per text: the mean over the text's positions, normalised to unit length. The contrastive
objective and the embedder both call this, so training and serving pool the same way."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """out: (texts, seq, embed_dim) head outputs; mask: (texts, seq), 1 on the text's tokens (its end
    token included), 0 on padding after it (``data.pairs.text_mask``) -> (texts, embed_dim) float32 unit vectors."""
    m = mask.to(torch.float32).unsqueeze(-1)                        # (texts, seq, 1)
    mean = (out.float() * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
    return F.normalize(mean, dim=-1)

