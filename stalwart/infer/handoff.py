"""A request's keys and values leaving one engine and entering another (prefill/decode disaggregation).

A prefill replica computes a prompt, samples the first token, and hands the request off: its cached keys
and values for every position computed so far (the prompt, and any tokens it resumed with) are copied out
of the paged cache as one tensor, (layers, 2, positions, kv_heads, head_dim), in the cache's dtype. A
decode replica takes them into blocks of its own cache (registered for prefix reuse like blocks it
computed) and goes on from the first token as if it had computed the prompt itself: the keys and values
are the same bits a colocated replica would have, so the tokens are too. Moving the tensor between
processes (a file in shared memory, safetensors: no pickle) is the server's business (serve/disagg.py).
"""

from __future__ import annotations

import torch

from stalwart.infer.attention import KVCache


def slots_of(blocks: list[int], n: int, block_size: int, device) -> torch.Tensor:
    """The cache slots of positions 0..n-1 of a sequence with block table ``blocks``."""
    pos = torch.arange(n)
    return (torch.tensor(blocks, dtype=torch.long)[pos // block_size] * block_size + pos % block_size).to(device)


def export_kv(caches: list[KVCache], blocks: list[int], n: int, block_size: int) -> torch.Tensor:
    """Keys and values of the first ``n`` positions, (layers, 2, n, kv_heads, head_dim), on the host."""
    slots = slots_of(blocks, n, block_size, caches[0].k.device)
    return torch.stack([torch.stack([c.k[slots], c.v[slots]]) for c in caches]).cpu()


def fits(caches: list[KVCache], kv: object, n: int) -> bool:
    """Whether ``kv`` is what ``export_kv`` gives for ``n`` positions of caches shaped like ``caches``."""
    k = caches[0].k
    return (isinstance(kv, torch.Tensor) and kv.dtype == k.dtype
            and tuple(kv.shape) == (len(caches), 2, n, *k.shape[1:]))


def import_kv(caches: list[KVCache], blocks: list[int], kv: torch.Tensor, block_size: int) -> None:
    """Write ``kv`` (checked by ``fits``) into the slots of positions 0.. of ``blocks``."""
    slots = slots_of(blocks, kv.shape[2], block_size, caches[0].k.device)
    kv = kv.to(caches[0].k.device)
    for c, layer in zip(caches, kv):
        c.k[slots] = layer[0]
        c.v[slots] = layer[1]
