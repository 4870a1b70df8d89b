"""Sparse mixture-of-experts feed-forward for one device: top-k router, grouped SwiGLU experts, shared experts.

The block replaces a dense SwiGLU in the layers the shape says are sparse. Per token the router scores
every expert (softmax or sigmoid), picks the top ``k`` (selection may add a balancing bias that does not
enter the combine weights: DeepSeek-V3's auxiliary-loss-free balancing), and the token's output is the
weighted sum of those experts' outputs, plus the shared experts' if any. No token is dropped: every
(token, expert) pair is computed, and an expert that receives no tokens simply computes nothing.

Expert parallelism is applied from outside: the routed experts are one module,
``GroupedExperts.forward(tokens_sorted_by_expert, tokens_per_expert)``, so a transform can hook its
input (dispatch the tokens to the ranks that own their experts with an all-to-all) and output (send the
results back) without this file knowing about ranks. Expert weights are stacked ``(experts, ...)``
tensors, so a rank's experts are a ``Shard(0)`` slice of the full tensor.

Routing replay: a forward pass may be handed a :class:`Routing`, which records the experts every sparse
layer chose for every token and/or imposes given ones (``replay``) instead of the layer's own top-k. The
combine weights are still the layer's own gate probabilities of the imposed experts (the same formula:
scores, gather, optional renormalisation), so the router keeps its gradient; with ``route_norm`` this is
the softmax over the imposed experts' logits, as in rollout routing replay (R3). RL uses it so the trainer
routes each token exactly as the generator that sampled it did.

Optional auxiliary balance loss: DeepSeek-V3's sequence-wise loss
``coef * sum_e f_e * P_e`` averaged over sequences, where ``f_e`` is the (scaled) fraction of a
sequence's tokens routed to ``e`` and ``P_e`` the sequence's mean routing probability. It is computed per
sequence, so its value does not depend on how a batch is split across ranks or micro-batches. Its
gradient is injected into the backward pass at the combine weights (:class:`_AddAuxGrad`), so neither
the loss function nor a pipeline schedule has to carry it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.models.flavors import MoEArgs


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local part of a sharded or replicated (DTensor) parameter; a plain tensor unchanged. The sparse
    block computes on local tensors: a tensor-parallel layout replicates its weights, expert parallelism
    shards the experts, and the tokens are always plain tensors."""
    return t.to_local() if hasattr(t, "to_local") else t


class _AddAuxGrad(torch.autograd.Function):
    """Identity on ``x`` whose backward also back-propagates ``scale * aux`` (d(total)/d(aux) = scale)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=grad.dtype, device=grad.device), None


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation checkpointing recomputes forward there)."""
    return torch._C._current_graph_task_id() != -1


def route_dtype(n_experts: int) -> torch.dtype:
    """The compact integer type that holds an expert index or -1 (nothing to replay)."""
    return torch.int8 if n_experts <= 127 else torch.int16


class Routing:
    """The experts of one forward pass's sparse layers, per token: recorded, replayed, or both.

    ``replay``: (batch, seq, sparse layers, k) expert indices in the order the layer chose them (the
    order fixes the order of the weighted sum), one column per sparse layer in layer order (a layer's
    column is its index minus ``moe.n_dense_layers``); a token whose first entry is -1 is routed as
    usual (padding). ``record``: keep each layer's chosen experts in ``chosen`` (column -> (tokens, k)).
    ``replayed`` / ``differed`` count the (token, layer) pairs replayed and those among them whose own
    top-k (as a set) was not the replayed one; ``layers`` counts the sparse layers that took part.
    """

    def __init__(self, replay: torch.Tensor | None = None, record: bool = False) -> None:
        self.replay, self.record = replay, record
        self.chosen: dict[int, torch.Tensor] = {}
        self.replayed = self.differed = self.layers = 0

    def select(self, column: int, own: torch.Tensor) -> torch.Tensor:
        """The experts layer ``column`` uses: ``own`` (tokens, k), its top-k, or the replayed ones."""
        counting = not _in_backward()  # activation checkpointing recomputes the forward: counted once
        selected = own
        if self.replay is not None:
            given = self.replay[:, :, column].reshape(own.shape).to(own.device, torch.long)  # (tokens, k)
            use = given[:, 0] >= 0  # (tokens,)
            selected = torch.where(use[:, None], given, own)
            if counting:  # tensors: no host sync per layer (read once, after the pass)
                other = (given.sort(-1).values != own.sort(-1).values).any(-1) & use
                self.replayed = self.replayed + use.sum()
                self.differed = self.differed + other.sum()
        if counting:
            self.layers += 1
        if self.record and counting:
            self.chosen[column] = selected.detach()
        return selected

    def stacked(self) -> torch.Tensor:
        """The recorded experts as (tokens, sparse layers, k), columns in order."""
        return torch.stack([self.chosen[c] for c in sorted(self.chosen)], 1)


class TopKRouter(nn.Module):
    """Scores, top-k selection and combine weights. ``expert_bias`` shifts selection only."""

    def __init__(self, dim: int, moe: MoEArgs) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(dim, moe.n_experts, bias=False)
        # Updated outside the gradient step by the balancer; saved with the model.
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts), persistent=True)

    def forward(self, x: torch.Tensor, routing: Routing | None = None, column: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (tokens, dim) -> scores (tokens, experts), selected (tokens, k), weights (tokens, k).
        ``routing``: records and/or replays the selection (this layer's ``column`` of it)."""
        logits = F.linear(x, _local(self.gate.weight)).float()
        scores = torch.softmax(logits, -1) if self.moe.score_func == "softmax" else torch.sigmoid(logits)
        selected = torch.topk(scores.detach() + self.expert_bias, self.moe.top_k, dim=-1).indices
        if routing is not None:
            selected = routing.select(column, selected)
        weights = scores.gather(-1, selected)
        if self.moe.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, selected, weights * self.moe.route_scale


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts as stacked weights: w1, w3 (experts, dim, hidden); w2 (experts, hidden, dim)."""

    def __init__(self, n: int, dim: int, hidden: int, grouped_mm: bool) -> None:
        super().__init__()
        self.grouped_mm = grouped_mm
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (tokens, dim) sorted by expert; counts: (experts,) tokens of each, in order. -> (tokens, dim)."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if self.grouped_mm:
            # One grouped matmul per projection over all experts (empty groups are fine).
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
            return torch._grouped_mm(h, w2, offs=offs)
        outs = []
        for e, part in enumerate(torch.split(x, counts.tolist())):
            if part.shape[0]:  # NOTE: an expert with no tokens contributes no gradient, not a zero one
                outs.append((F.silu(part @ w1[e]) * (part @ w3[e])) @ w2[e])
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


class MoE(nn.Module):
    """Routed experts (+ shared experts). Keeps per-step routing statistics for telemetry and balancing."""

    def __init__(self, dim: int, moe: MoEArgs, shared_ffn: nn.Module | None, layer: int | None = None) -> None:
        super().__init__()
        self.moe = moe
        self.layer = moe.n_dense_layers if layer is None else layer  # its column in a Routing
        self.router = TopKRouter(dim, moe)
        self.experts = GroupedExperts(moe.n_experts, dim, moe.hidden, moe.grouped_mm)
        self.shared_experts = shared_ffn
        self.aux_grad_scale = 1.0  # set by the step runner: the factor the main loss is scaled by
        # Statistics accumulated over a step's forward passes (not saved; reset by whoever reads them).
        n = moe.n_experts
        self.register_buffer("stat_tokens", torch.zeros(n, dtype=torch.float64), persistent=False)
        self.register_buffer("stat_misc", torch.zeros(4, dtype=torch.float64), persistent=False)  # see STAT_MISC

    STAT_MISC = ("aux_loss_sum", "entropy_sum", "tokens", "forwards")

    def reset_stats(self) -> None:
        self.stat_tokens.zero_()
        self.stat_misc.zero_()

    def reset_buffers(self) -> None:
        """After materializing from the meta device: a zero balancing bias and zero statistics."""
        self.router.expert_bias.zero_()
        self.reset_stats()

    def forward(self, x: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        """x: (batch, seq, dim); ``routing``: records and/or replays each token's experts."""
        bs, seq, dim = x.shape  # (batch, seq, dim)
        flat = x.reshape(-1, dim)
        column = self.layer - self.moe.n_dense_layers
        scores, selected, weights = self.router(flat, routing, column)  # (N, E), (N, k), (N, k)
        n_exp, k = self.moe.n_experts, self.moe.top_k
        counts = torch.bincount(selected.flatten(), minlength=n_exp)  # (E,)
        aux = self._aux_loss(scores, selected, bs, seq)
        if aux is not None and torch.is_grad_enabled():
            weights = _AddAuxGrad.apply(weights, aux, self.aux_grad_scale)
        # Statistics of training forwards only: not evaluation, not a recomputation during backward
        # (activation checkpointing), not a pipeline stage's shape inference (runs without grad).
        if self.training and torch.is_grad_enabled() and not _in_backward():
            self._record(scores, counts, aux)
        # Sort the N*k (token, expert) pairs by expert; stable, so each expert sees tokens in order.
        order = torch.argsort(selected.flatten(), stable=True)  # (N*k,)
        routed = flat[order // k]  # (N*k, dim) grouped by expert
        out = self.experts(routed, counts)  # (N*k, dim)
        out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        y = unsorted.view(-1, k, dim).sum(1)  # (N, dim)
        if self.shared_experts is not None:
            se = self.shared_experts
            w1, w2, w3 = (_local(lin.weight) for lin in (se.w1, se.w2, se.w3))
            y = y + F.linear(F.silu(F.linear(flat, w1)) * F.linear(flat, w3), w2)
        return y.view(bs, seq, dim)

    def _aux_loss(self, scores: torch.Tensor, selected: torch.Tensor, bs: int, seq: int) -> torch.Tensor | None:
        if self.moe.aux_loss_coef <= 0:
            return None
        n_exp, k = self.moe.n_experts, self.moe.top_k
        probs = scores / scores.sum(-1, keepdim=True)  # normalised (sigmoid scores do not sum to 1)
        p = probs.view(bs, seq, n_exp).mean(1)  # (batch, E)
        hits = F.one_hot(selected.view(bs, seq * k), n_exp).sum(1).to(p.dtype)  # (batch, E)
        f = hits * n_exp / (k * seq)
        return self.moe.aux_loss_coef * (f * p).sum(-1).mean()

    @torch.no_grad()
    def _record(self, scores: torch.Tensor, counts: torch.Tensor, aux: torch.Tensor | None) -> None:
        probs = scores / scores.sum(-1, keepdim=True)
        entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1).sum()
        self.stat_tokens += counts.to(self.stat_tokens.dtype)
        zero = torch.zeros((), dtype=torch.float64, device=scores.device)  # no host sync on an accelerator
        aux_value = aux.detach().double() if aux is not None else zero
        self.stat_misc += torch.stack([aux_value, entropy.double(), zero + scores.shape[0], zero + 1])


def moe_modules(model: nn.Module) -> dict[int, MoE]:
    """Layer index -> MoE block of every sparse layer this model (or pipeline stage) holds."""
    layers = getattr(model, "layers", {})
    return {int(i): b.moe for i, b in layers.items() if getattr(b, "moe", None) is not None}


def set_aux_grad_scale(model: nn.Module, scale: float) -> None:
    """Scale the auxiliary loss's gradient like the main loss's (1 / micro-batches without a pipeline)."""
    for m in moe_modules(model).values():
        m.aux_grad_scale = scale
