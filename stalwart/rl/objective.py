"""The policy objective (every ``rl.algorithm``: GRPO, DAPO, RLOO, Dr. GRPO) as a training-core loss
function, and the statistics of the step it computed. The algorithms differ here only in their clip
bounds and aggregation; their advantages arrive in the rows (``grpo.group_advantages``).

``TrainCore.train_step(micro, loss_fn=objective)`` hands it (logits, rows) per micro-batch, where rows
is the packed float64 tensor of ``rollout.pack_group`` (target token, old log-probability, advantage,
mask, weight, reference log-probability, on-policy flag per position). The loss of one micro-batch is
its weighted share of the global aggregate, so gradient accumulation and data parallelism add up to
exactly ``grpo.aggregate`` over the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stalwart.rl.grpo import clipped_surrogate, kl_k3
from stalwart.rl.rollout import (
    ADVANTAGE,
    MASK,
    OLD_LOGP,
    ON_POLICY,
    REF_LOGP,
    TOKEN,
    WEIGHT,
)

STATS = ("tokens", "clipped", "kl_sum", "mismatch_sum", "mismatch_max", "onpolicy_tokens", "ratio_max",
         "policy_sum", "entropy_sum")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) per position, in float32, from (batch, seq, vocab) logits."""
    return -F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(), reduction="none").view(tokens.shape)


class GRPOObjective:
    def __init__(self, clip_low: float, clip_high: float, how: str, kl_coef: float,
                 track_mismatch: bool = True, own_old: bool = False) -> None:
        self.clip_low, self.clip_high, self.how, self.kl_coef = clip_low, clip_high, how, kl_coef
        self.track_mismatch = track_mismatch
        # The old log-probability of an on-policy token is this very forward's (detached): the trainers'
        # exact mode on the step's first update, which runs on the weights that generated the samples.
        self.own_old = own_old
        self.reset()

    def reset(self) -> None:
        self.stats = torch.zeros(len(STATS), dtype=torch.float64)

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if self.stats.device != logits.device:  # summed where the logits are (one copy to the host per step)
            self.stats = self.stats.to(logits.device)
        tokens = rows[..., TOKEN].long()
        mask = rows[..., MASK].float()
        logp = token_logprobs(logits, tokens)
        old = rows[..., OLD_LOGP].float()
        if self.own_old:
            old = torch.where((mask > 0) & (rows[..., ON_POLICY] > 0), logp.detach(), old)
        adv = rows[..., ADVANTAGE].float()
        weight = rows[..., WEIGHT].float()
        per_token, ratio, clipped, unclipped = clipped_surrogate(logp, old, adv, self.clip_low, self.clip_high)
        if self.kl_coef > 0:
            per_token = per_token + self.kl_coef * kl_k3(logp, rows[..., REF_LOGP].float())
        if self.how == "token-mean":
            loss = (per_token * mask * weight).sum()
        else:  # per response: the weight of seq-mean-token-sum-norm also holds its 1 / max_tokens
            per_seq = (per_token * mask).sum(dim=1)
            if self.how == "seq-mean-token-mean":
                per_seq = per_seq / mask.sum(dim=1).clamp(min=1)
            loss = (per_seq * weight[:, 0]).sum()
        self._account(logp.detach(), old, ratio.detach(), clipped.detach() < unclipped.detach(), mask,
                      rows[..., ON_POLICY].float(), rows[..., REF_LOGP].float(), per_token.detach(), logits)
        return loss

    @torch.no_grad()
    def _account(self, logp, old, ratio, was_clipped, mask, onpolicy, ref, per_token, logits) -> None:
        diff = (logp - old).abs() * mask * onpolicy * float(self.track_mismatch)
        probs = torch.softmax(logits.detach().float(), dim=-1)
        entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1)
        s = self.stats
        s[0] += mask.sum()
        s[1] += (was_clipped.float() * mask).sum()
        s[2] += (kl_k3(logp, ref) * mask).sum() if self.kl_coef > 0 else 0.0
        s[3] += diff.sum()
        s[4] = max(float(s[4]), float(diff.max()) if diff.numel() else 0.0)
        s[5] += (mask * onpolicy).sum() * float(self.track_mismatch)
        s[6] = max(float(s[6]), float((ratio * mask).max()) if ratio.numel() else 0.0)
        s[7] += (per_token * mask).sum()
        s[8] += (entropy * mask).sum()


def summarize(stats: torch.Tensor) -> dict[str, float]:
    """The step's figures from statistics summed (maxima: maxed) over micro-batches and ranks."""
    d = dict(zip(STATS, stats.tolist()))
    tok = max(d["tokens"], 1.0)
    on = d["onpolicy_tokens"]
    return {"clip_fraction": d["clipped"] / tok, "kl": d["kl_sum"] / tok, "entropy": d["entropy_sum"] / tok,
            "logprob_mismatch_mean": d["mismatch_sum"] / on if on else None,
            "logprob_mismatch_max": d["mismatch_max"] if on else None, "ratio_max": d["ratio_max"],
            "policy_loss": d["policy_sum"] / tok, "train_tokens": int(d["tokens"])}


def masked_cross_entropy(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning: next-token loss on the response tokens only (the prompt is context),
    weighted like the policy loss (each rank's micro-batch is its share of the global token mean)."""
    logp = token_logprobs(logits, rows[..., TOKEN].long())
    return -(logp * rows[..., MASK].float() * rows[..., WEIGHT].float()).sum()
