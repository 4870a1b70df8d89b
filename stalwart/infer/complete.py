"""One prompt through the inference engine: `stalwart generate` and the end-of-training sample.

There is one generation path: the engine's (KV-cached, prefilled in one step, one token a step after
that, fused projections read in place). A single prompt runs through it with an engine sized for it
alone: one sequence, a KV cache that holds its context, the whole prompt in the first step. The
randomness is the engine's (``generate.TokenDraws``: token i from (seed, i)), so a seed draws the same
tokens here as in a served request with that seed and the same sampling parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from stalwart.config.serve import EngineConfig
from stalwart.infer.engine import Engine
from stalwart.infer.sampling import SamplingParams


@dataclass
class Completion:
    tokens: list[int]  # generated, without the end-of-text token that ended them
    prompt: list[int]  # the prompt the model saw (its last tokens, when the context could not hold it all)
    capped: bool  # fewer new tokens were allowed than asked for: the model's context is full


def fit_context(prompt: list[int], max_new_tokens: int, max_seq_len: int, eos_id: int | None
                ) -> tuple[list[int], int, bool]:
    """The prompt and the number of new tokens that fit in a context of ``max_seq_len`` tokens: an empty
    prompt starts from the end-of-text token (or token 0); at least one prompt token is kept, the newest;
    new tokens are capped at the context less that token, and the prompt keeps its last tokens that fit
    beside them. Returns (prompt, new tokens, whether the new tokens were capped)."""
    prompt = list(prompt) or [eos_id if eos_id is not None else 0]
    new = min(max_new_tokens, max_seq_len - 1)
    keep = max(1, max_seq_len - new)
    return prompt[-keep:], new, new < max_new_tokens


def engine_for_one(model: nn.Module, context_tokens: int, prompt_tokens: int, eos_id: int | None) -> Engine:
    """An engine over ``model`` (which it takes over: its attention then reads a paged cache) for one
    sequence of ``context_tokens`` tokens at most, prefilling its ``prompt_tokens`` in one step."""
    cfg = EngineConfig()
    weight = next(model.parameters())
    a = model.args
    per_token = 2 * a.n_layers * a.n_kv_heads * a.head_dim * weight.element_size()
    blocks = -(-context_tokens // cfg.block_size) + 1
    cfg = EngineConfig(kv_cache_mb=max(1.0, blocks * cfg.block_size * per_token / 2**20), max_seqs=1,
                       max_batch_tokens=max(cfg.block_size, prompt_tokens), prefix_caching=False)
    return Engine(model, None, eos_id, cfg)


def complete(model: nn.Module, prompt: list[int], max_new_tokens: int, temperature: float = 0.8, top_k: int = 40,
             seed: int = 0, eos_id: int | None = None, top_p: float = 1.0) -> Completion:
    """Up to ``max_new_tokens`` tokens continuing ``prompt``, stopping at ``eos_id``, through the engine
    on ``model``'s device (``model`` becomes the engine's: use it for nothing else afterwards)."""
    prompt, new, capped = fit_context(prompt, max_new_tokens, model.args.max_seq_len, eos_id)
    if new <= 0:
        return Completion([], prompt, capped)
    engine = engine_for_one(model, len(prompt) + new, len(prompt), eos_id)
    engine.add("0", prompt, SamplingParams(max_tokens=new, temperature=temperature, top_k=top_k, top_p=top_p,
                                           seed=seed))
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            tokens += [c.token for c in out.choices]
    if tokens and eos_id is not None and tokens[-1] == eos_id:
        tokens.pop()
    return Completion(tokens, prompt, capped)
