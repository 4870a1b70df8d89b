"""GRPO: group-relative advantages and the clipped policy loss, with an optional KL penalty.

Pure tensor math, no I/O. Shapes: a batch holds `groups` prompts with `k` sampled responses each;
per-token tensors are (responses, tokens) with a 0/1 `mask` marking response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards (groups, k) -> advantages (groups, k): reward minus its group's mean, divided by the
    group's standard deviation (unbiased, as GRPO and verl do) when `scale`. A group whose responses
    all scored alike gets zero advantage: it carries no signal."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (groups, k) with k >= 2, got {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate, Schulman's k3: exp(r) - r - 1 with r = ref - logp.
    Unbiased, never negative, low variance."""
    r = ref_logp - logp
    return torch.exp(r) - r - 1


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: Aggregation) -> torch.Tensor:
    """Reduce per-token values (responses, tokens) to a scalar.
    token-mean: every response token weighs the same (long responses weigh more in total);
    seq-mean-token-sum: sum over a response's tokens, mean over responses (Dr. GRPO style when the
    sum is later divided by a constant); seq-mean-token-mean: mean per response, then over responses
    (the original GRPO)."""
    mask = mask.to(values.dtype)
    if how == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1)
    per_seq = (values * mask).sum(dim=1)
    if how == "seq-mean-token-sum":
        return per_seq.mean()
    if how == "seq-mean-token-mean":
        return (per_seq / mask.sum(dim=1).clamp(min=1)).mean()
    raise ValueError(f"unknown aggregation {how!r}")


@dataclass
class LossParts:
    loss: torch.Tensor        # what backward() runs on
    policy: torch.Tensor      # the clipped surrogate term (detached)
    kl: torch.Tensor          # mean per-token KL to the reference (0 without one; detached)
    clip_fraction: torch.Tensor  # share of response tokens whose ratio was clipped (detached)
    ratio_max: torch.Tensor


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, how: Aggregation = "token-mean",
                ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0) -> LossParts:
    """PPO-clipped GRPO loss. logp/old_logp/ref_logp: (responses, tokens) log-probabilities of the
    sampled tokens under the policy being trained, the policy that generated them, and the frozen
    reference; advantages: (responses,), broadcast over each response's tokens."""
    adv = advantages.unsqueeze(1).to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    policy = aggregate(per_token, mask, how)
    loss = policy
    kl = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None and kl_coef > 0:
        kl_tok = kl_k3(logp, ref_logp)
        loss = loss + kl_coef * aggregate(kl_tok, mask, how)
        kl = aggregate(kl_tok.detach(), mask, "token-mean")
    was_clipped = (clipped < unclipped).to(logp.dtype)
    m = mask.to(logp.dtype)
    return LossParts(loss, policy.detach(), kl,
                     ((was_clipped * m).sum() / m.sum().clamp(min=1)).detach(),
                     (ratio.detach() * m).max())
