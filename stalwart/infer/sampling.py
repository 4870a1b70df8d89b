"""A request's sampling: its parameters, its generator, the logit adjustments it asks for, and
log-probabilities on request. The token itself is drawn by the one sampler, ``stalwart.generate.next_token``.

Each request has its own randomness (``generate.TokenDraws``, from its ``seed`` or a fresh random one),
counter-based: output token i is drawn with a generator seeded by (seed, i) alone. Each row is sampled
on its own, so a request samples the same tokens whether it shares the batch with 31 others or runs
alone, and a request resumed on another replica from its first i tokens draws token i as it would have. Log-probabilities are those of the model's distribution (the raw logits),
not of the temperature-scaled, biased or penalized one, as OpenAI's API reports them.

Adjustments (``adjust_logits``: ``logit_bias``, presence and frequency penalties, ``min_tokens``) change
the logits before ``next_token`` sees them; a request that sets none of them goes straight to
``next_token`` with the model's logits, so it draws exactly what ``stalwart generate`` draws for the
same seed. Other constraints (a token mask, say) compose by adjusting the same logits first.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from stalwart.generate import TokenDraws, next_token, next_tokens

# The seeds torch's generator takes: any 64-bit integer, signed or unsigned.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_STOP = 4  # stop strings, as OpenAI allows; stop token ids are not limited
MAX_LOGPROBS = 20


class SamplingError(ValueError):
    """A request parameter out of range; the message names the field, ``param`` is its name."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16  # 0: nothing generated (the prompt scored, with prompt_logprobs)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # end the output like the end-of-text token
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo)
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0  # no end-of-text or stop token (nor stop string) before this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per time a token was already generated
    # infer.structured.Constraint: the output must match it (a JSON schema, regex, grammar); None: free
    structured: object | None = None

    def validate(self) -> None:
        if self.max_tokens < 0:
            raise SamplingError(f"max_tokens must be >= 0 (got {self.max_tokens})", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError(f"temperature must be in [0, 2] (got {self.temperature})", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1] (got {self.top_p})", "top_p")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (got {self.top_k})", "top_k")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise SamplingError(f"logprobs must be in [0, {MAX_LOGPROBS}] (got {k})", "logprobs")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError(f"stop must be up to {MAX_STOP} non-empty strings", "stop")
        if self.seed is not None and not (type(self.seed) is int and SEED_MIN <= self.seed <= SEED_MAX):
            raise SamplingError(f"seed must be an integer in [-2**63, 2**64 - 1] (got {self.seed})", "seed")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}] (got {self.min_tokens})",
                                "min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2] (got {getattr(self, name)})", name)
        for token, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise SamplingError(f"logit_bias values must be in [-100, 100] (got {bias} for token {token})",
                                    "logit_bias")

    def check_tokens(self, vocab_size: int) -> None:
        """The token ids the request names exist in a vocabulary of ``vocab_size``."""
        for name in ("logit_bias", "stop_token_ids"):
            bad = [t for t in getattr(self, name) if not 0 <= t < vocab_size]
            if bad:
                raise SamplingError(f"{name}: token id {bad[0]} is not in [0, {vocab_size})", name)

    def draws(self) -> TokenDraws:
        """The request's randomness: from its seed, or from a fresh random one."""
        return TokenDraws(self.seed if self.seed is not None else random.SystemRandom().randrange(2**63))

    @property
    def adjusts(self) -> bool:
        """Whether ``adjust_logits`` changes anything for this request."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.min_tokens)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request asking for several (``n``, ``best_of``): choice 0 uses
    the request's seed itself (so ``n = 1`` draws what ``stalwart generate --seed`` draws); choice i > 0
    uses the first 8 bytes (little endian, unsigned) of BLAKE2b-64 of ``"<seed>:<i>"``. No seed: none."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def stops_on(token: int, params: SamplingParams, eos_id: int | None) -> bool:
    """Whether ``token`` ends the output: the end-of-text token (unless ``ignore_eos``) or a stop token."""
    return (token == eos_id and not params.ignore_eos) or token in params.stop_token_ids


def adjust_logits(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int],
                  eos_id: int | None) -> torch.Tensor:
    """The logits a request samples from, given the tokens it ``generated`` so far (vocab,), fp32.

    In order: ``logit_bias`` added; OpenAI's penalties, ``logit[t] -= frequency_penalty * count(t) +
    presence_penalty * (count(t) > 0)`` over the generated tokens; before ``min_tokens`` tokens, the
    end-of-text token and the stop tokens set to -inf. Returns ``logits`` itself when nothing applies.
    """
    if not params.adjusts:
        return logits
    logits = logits.clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
    if (params.presence_penalty or params.frequency_penalty) and generated:
        counts = Counter(generated)
        ids = torch.tensor(list(counts), dtype=torch.long)
        n = torch.tensor(list(counts.values()), dtype=logits.dtype)
        logits[ids] -= params.frequency_penalty * n + params.presence_penalty
    if len(generated) < params.min_tokens:
        banned = [t for t in (*params.stop_token_ids, eos_id) if t is not None]
        if banned:
            logits[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    return logits


@dataclass
class Choice:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token, logprob), most likely first


def sample_row(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator, generated: Sequence[int] = (),
               eos_id: int | None = None, allowed: torch.Tensor | None = None) -> Choice:
    """One token from one row of logits (vocab,), fp32 on the host, drawn by the one sampler
    (``generate.next_token``) after the request's adjustments and, for a structured output, only among
    the ``allowed`` tokens (its grammar's mask); with the model's log-probabilities when the request
    asks for them."""
    token = next_token(adjust_logits(logits, params, generated, eos_id), params.temperature, params.top_k,
                       params.top_p, gen, allowed)
    if params.logprobs is None:
        return Choice(token)
    logp = torch.log_softmax(logits, dim=-1)
    top = None
    if params.logprobs > 0:
        values, ids = torch.topk(logp, params.logprobs)
        top = [(int(i), float(v)) for i, v in zip(ids, values)]
    return Choice(token, float(logp[token]), top)


def sample_rows(logits: torch.Tensor, rows: list[tuple[SamplingParams, Callable[[], torch.Generator],
                                                      Sequence[int], torch.Tensor | None]],
                eos_id: int | None) -> list[Choice]:
    """``sample_row`` of each row of ``logits`` (rows, vocab), fp32 on the host; ``rows`` holds each
    row's (params, a callable giving its generator, generated tokens, allowed mask). Rows whose requests
    sample alike (the same temperature, top-k and top-p, no adjustments, no grammar, no top
    log-probabilities) go through ``next_tokens`` together: the same tokens and log-probabilities, bit
    for bit, as row by row (tests/test_sampling.py), at a fraction of the operator calls."""
    choices: list[Choice | None] = [None] * len(rows)
    alike: dict[tuple[float, int, float], list[int]] = {}
    for i, (params, draw, generated, allowed) in enumerate(rows):
        if allowed is not None or params.adjusts or params.logprobs:
            gen = draw() if params.temperature > 0.0 else None
            choices[i] = sample_row(logits[i], params, gen, generated, eos_id, allowed)
        else:
            alike.setdefault((params.temperature, params.top_k, params.top_p), []).append(i)
    for (temperature, top_k, top_p), idx in alike.items():
        x = logits if len(idx) == len(rows) else logits[idx]
        tokens = next_tokens(x, temperature, top_k, top_p, [rows[i][1] for i in idx])
        scored = [j for j, i in enumerate(idx) if rows[i][0].logprobs is not None]
        logps = torch.log_softmax(x[scored], dim=-1)[range(len(scored)), [tokens[j] for j in scored]].tolist() \
            if scored else []
        for j, i in enumerate(idx):
            choices[i] = Choice(tokens[j])
        for j, lp in zip(scored, logps):
            choices[idx[j]].logprob = lp
    return choices  # type: ignore[return-value]


def score_rows(logits: torch.Tensor, targets: list[int], k: int) -> list[Choice]:
    """The log-probability of each of ``targets`` under its row of ``logits`` (rows, vocab), fp32 on the
    host, with the ``k`` most likely tokens of each row: the prompt's log-probabilities (echo)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, torch.tensor(targets, dtype=torch.long)[:, None])[:, 0].tolist()
    if k == 0:
        return [Choice(t, lp) for t, lp in zip(targets, chosen)]
    values, ids = torch.topk(logp, k, dim=-1)
    return [Choice(t, lp, list(zip(i, v))) for t, lp, i, v in zip(targets, chosen, ids.tolist(), values.tolist())]
