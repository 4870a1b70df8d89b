"""A request's sampling: its parameters, its generator, log-probabilities on request. The token itself
is drawn by the one sampler, ``stalwart.generate.next_token``.

Each request has its own random generator (seeded from its ``seed``, or from a fresh random seed), and
each row is sampled on its own, so a request samples the same tokens whether it shares the batch with
31 others or runs alone. Log-probabilities are those of the model's distribution (the raw logits),
not of the temperature-scaled one, as OpenAI's API reports them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from stalwart.generate import next_token
from stalwart.runtime.device import host_generator


# The seeds torch's generator takes: any 64-bit integer, signed or unsigned.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class SamplingError(ValueError):
    """A request parameter out of range; the message names the field, ``param`` is its name."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: and the k most likely
    seed: int | None = None
    ignore_eos: bool = False
    # infer.structured.Constraint: the output must match it (a JSON schema, regex, grammar); None: free
    structured: object | None = None

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1 (got {self.max_tokens})", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError(f"temperature must be in [0, 2] (got {self.temperature})", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1] (got {self.top_p})", "top_p")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (got {self.top_k})", "top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingError(f"logprobs must be in [0, 20] (got {self.logprobs})", "logprobs")
        if len(self.stop) > 4 or any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError("stop must be up to 4 non-empty strings", "stop")
        if self.seed is not None and not (type(self.seed) is int and SEED_MIN <= self.seed <= SEED_MAX):
            raise SamplingError(f"seed must be an integer in [-2**63, 2**64 - 1] (got {self.seed})", "seed")

    def generator(self) -> torch.Generator:
        seed = self.seed if self.seed is not None else random.SystemRandom().randrange(2**63)
        return host_generator(seed)


@dataclass
class Choice:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token, logprob), most likely first


def sample_row(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator,
               allowed: torch.Tensor | None = None) -> Choice:
    """One token from one row of logits (vocab,), fp32 on the host, drawn by the one sampler
    (``generate.next_token``), for a structured output only among the ``allowed`` tokens (its grammar's
    mask); with its log-probabilities when the request asks for them."""
    token = next_token(logits, params.temperature, params.top_k, params.top_p, gen, allowed)
    if params.logprobs is None:
        return Choice(token)
    logp = torch.log_softmax(logits, dim=-1)
    top = None
    if params.logprobs > 0:
        values, ids = torch.topk(logp, params.logprobs)
        top = [(int(i), float(v)) for i, v in zip(ids, values)]
    return Choice(token, float(logp[token]), top)
