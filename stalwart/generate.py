"""Choosing tokens: the one sampler (greedy, temperature, top-k, top-p).

``next_token`` is the one place a token is drawn from logits; the inference engine calls it
(``infer/sampling.py``, per request, with log-probabilities), and every generation runs through the
engine: the server, `stalwart generate` and the end-of-training sample (``infer/complete.py``). Sampling happens on the host with a host generator, so the same seed
draws the same tokens whatever device computed the logits.

The randomness is counter-based (``TokenDraws``): the draws for output token i come from a generator
seeded with (seed, i) alone, never from one stream advanced token by token. Which token is drawn at
position i then depends on the seed, i and that position's logits only, however the tokens before it
were produced: one step at a time, several at once by speculative decoding, or on another replica that
resumed the request from its first i tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from stalwart.runtime.device import host_generator


def token_seed(seed: int, index: int, stream: int = 0) -> int:
    """The seed of output token ``index``'s draws from stream ``stream`` (0: the token's own draws; 1: a
    speculative draft's), for a request seeded ``seed``: the first 8 bytes (little endian, unsigned) of
    BLAKE2b-64 of ``"<seed>:<index>:<stream>"``."""
    digest = hashlib.blake2b(f"{seed}:{index}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class TokenDraws:
    """One seeded request's randomness, by output position: ``at(i)`` is a generator for token i's draws
    (one generator object, reseeded per call: use it before the next call)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._gen = host_generator(0)

    def at(self, index: int, stream: int = 0) -> torch.Generator:
        return self._gen.manual_seed(token_seed(self.seed, index, stream))


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float = 1.0) -> torch.Tensor:
    """Scaled logits with everything outside top-k / the top-p nucleus set to -inf. logits: (..., vocab),
    each row on its own."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                gens: list[Callable[[], torch.Generator]]) -> list[int]:
    """One token per row of logits (rows, vocab), fp32 on the host, all rows sampled alike: the most
    likely at temperature 0, else row i drawn with the generator ``gens[i]()`` returns (called just
    before its draw; greedy calls none).

    The draw is ``torch.multinomial``'s own for one sample, made for every row at once: q ~ Exp(1) drawn
    from the row's generator, the token argmax(p / q). So each row's token is the one
    ``torch.multinomial(p, 1, generator=...)`` draws for it alone, whatever else is in the batch."""
    if temperature <= 0.0:
        return logits.argmax(-1).tolist()
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    if not bool(((probs >= 0) & (probs < float("inf"))).all()):  # NaN fails both, as in multinomial
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    q = torch.empty_like(probs)
    for row, gen in zip(q, gens):
        row.exponential_(1, generator=gen())
    return (probs / q).argmax(-1).tolist()


def next_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               gen: torch.Generator | None, allowed: torch.Tensor | None = None) -> int:
    """One token from one row of logits (vocab,), fp32 on the host (``next_tokens`` of that row): the
    most likely at temperature 0, else one draw from ``gen`` (greedy draws nothing, so it leaves
    ``gen`` as it was).

    ``allowed`` (vocab,) bool, when given, is a mask (a structured output's grammar): every other token
    is set to -inf first, greedy or not. Without it the logits are used as they are."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return next_tokens(logits[None], temperature, top_k, top_p, [lambda: gen])[0]
