"""Autoregressive sampling (greedy, temperature, top-k) from any Stalwart model.

Works on a single-device model and on an FSDP-sharded one: with a ``sync`` callback every rank
adopts rank 0's token, so all ranks run the same forwards (FSDP's collectives stay matched).
"""

from __future__ import annotations

from typing import Callable

import torch


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, max_seq_len: int,
           temperature: float = 0.8, top_k: int = 40, seed: int = 0, eos: int | None = None,
           device: torch.device | str = "cpu",
           sync: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[int]:
    was_training = model.training
    model.eval()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt) or ([eos] if eos is not None else [0])
    out: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-max_seq_len:]], dtype=torch.long, device=device)
        logits = model(context)[0, -1].float().cpu()
        if temperature <= 0:
            nxt = torch.argmax(logits).view(1)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        if sync is not None:
            nxt = sync(nxt)
        token = int(nxt.item())
        if eos is not None and token == eos:
            break
        ids.append(token)
        out.append(token)
    model.train(was_training)
    return out
