"""The plain autoregressive loop, kept as the tests' reference for the inference engine: every step runs
the whole context through the model's own forward (no cache, no paging, no batching) and draws the next
token with the one sampler, as the engine does (``generate.TokenDraws``: token i from (seed, i))."""

from __future__ import annotations

import torch

from stalwart.generate import TokenDraws, next_token
from stalwart.runtime.device import HOST


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, max_seq_len: int,
           temperature: float = 0.8, top_k: int = 40, seed: int = 0, eos: int | None = None) -> list[int]:
    """Up to ``max_new_tokens`` tokens continuing ``prompt`` (stopping before ``eos``), on the model's
    device; each step runs the whole (last ``max_seq_len`` tokens of the) context through the model."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    draws = TokenDraws(seed)
    ids = list(prompt) or ([eos] if eos is not None else [0])
    out: list[int] = []
    for i in range(max_new_tokens):
        context = torch.tensor([ids[-max_seq_len:]], dtype=torch.long, device=device)
        logits = model(context)[0, -1].float().to(HOST)
        token = next_token(logits, temperature, top_k, 1.0, draws.at(i))
        if eos is not None and token == eos:
            break
        ids.append(token)
        out.append(token)
    model.train(was_training)
    return out
