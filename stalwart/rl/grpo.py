"""The policy-gradient family: group advantages and the clipped policy loss, with an optional KL penalty.

One family, four members (``rl.algorithm``), which differ only in the pieces below:

| algorithm | advantage (``group_advantages``) | clip (``clipped_surrogate``) | aggregation (``aggregate``) |
|---|---|---|---|
| grpo | (r - mean) / (std + eps), or r - mean without scaling | symmetric | as configured |
| dapo | (r - mean) / (std + eps) | clip-higher: 1 + 0.28 above | token-mean; zero-variance groups refilled |
| rloo | r - mean of the other k - 1 rewards | symmetric | as configured |
| dr_grpo | r - mean (no std) | symmetric | token sum / max_tokens, mean over responses |

Pure tensor math, no I/O. Shapes: a batch holds `groups` prompts with `k` sampled responses each;
per-token tensors are (responses, tokens) with a 0/1 `mask` marking response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stalwart.config.rl import Aggregation, Algorithm


def group_advantages(rewards: list[list[float]], algorithm: Algorithm = "grpo", scale: bool = True,
                     eps: float = 1e-6) -> list[np.ndarray]:
    """One group's rewards (k of them, k >= 2) per entry -> its advantages, float64.

    grpo / dapo: reward minus the group's mean, divided by the group's (unbiased, as GRPO and verl do)
    standard deviation plus ``eps`` when ``scale``; dr_grpo: only the centring; rloo: reward minus the
    mean of the group's other rewards (the leave-one-out baseline). A group whose responses all scored
    alike gets zero advantage under every member: it carries no signal."""
    out = []
    for r in rewards:
        a = np.asarray(r, dtype=np.float64)
        if a.ndim != 1 or a.shape[0] < 2:
            raise ValueError(f"every group needs k >= 2 rewards, got {a.shape}")
        if algorithm == "rloo":
            out.append(a - (a.sum() - a) / (a.shape[0] - 1))
            continue
        c = a - a.mean()
        out.append(c / (a.std(ddof=1) + eps) if scale and algorithm in ("grpo", "dapo") else c)
    return out


def informative(rewards: list[float]) -> bool:
    """Whether a group's rewards differ: only then does it carry a policy gradient (DAPO's dynamic
    sampling keeps these and samples more groups in place of the others)."""
    return max(rewards) != min(rewards)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate, Schulman's k3: exp(r) - r - 1 with r = ref - logp.
    Unbiased, never negative, low variance."""
    r = ref_logp - logp
    return torch.exp(r) - r - 1


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                      clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``
    with ``ratio = exp(logp - old_logp)`` (``adv`` broadcast to the tokens). DAPO's clip-higher is
    ``clip_high > clip_low``. Returns (per-token loss, ratio, clipped term, unclipped term)."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    return -torch.minimum(unclipped, clipped), ratio, clipped, unclipped


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: Aggregation, max_tokens: int = 1) -> torch.Tensor:
    """Reduce per-token values (responses, tokens) to a scalar.
    token-mean: every response token weighs the same (long responses weigh more in total; DAPO's
    token-level loss); seq-mean-token-sum: sum over a response's tokens, mean over responses;
    seq-mean-token-sum-norm: the same divided by the constant ``max_tokens`` (Dr. GRPO: no length
    normalisation per response); seq-mean-token-mean: mean per response, then over responses (the
    original GRPO)."""
    mask = mask.to(values.dtype)
    if how == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1)
    per_seq = (values * mask).sum(dim=1)
    if how == "seq-mean-token-sum":
        return per_seq.mean()
    if how == "seq-mean-token-sum-norm":
        return per_seq.mean() / max_tokens
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
                ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0, max_tokens: int = 1) -> LossParts:
    """The family's loss over a whole batch. logp/old_logp/ref_logp: (responses, tokens) log-probabilities
    of the sampled tokens under the policy being trained, the policy that generated them, and the frozen
    reference; advantages: (responses,), broadcast over each response's tokens. The trainer computes the
    same per micro-batch (``objective.GRPOObjective``), weighted so the parts add up to this."""
    adv = advantages.unsqueeze(1).to(logp.dtype)
    per_token, ratio, clipped, unclipped = clipped_surrogate(logp, old_logp, adv, clip_low, clip_high)
    policy = aggregate(per_token, mask, how, max_tokens)
    loss = policy
    kl = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None and kl_coef > 0:
        kl_tok = kl_k3(logp, ref_logp)
        loss = loss + kl_coef * aggregate(kl_tok, mask, how, max_tokens)
        kl = aggregate(kl_tok.detach(), mask, "token-mean")
    was_clipped = (clipped < unclipped).to(logp.dtype)
    m = mask.to(logp.dtype)
    return LossParts(loss, policy.detach(), kl,
                     ((was_clipped * m).sum() / m.sum().clamp(min=1)).detach(),
                     (ratio.detach() * m).max())
