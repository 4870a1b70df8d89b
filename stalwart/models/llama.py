"""A Llama-style decoder for one device: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Written so parallelism can be applied from outside without touching this file:
- layers live in an ``nn.ModuleDict`` keyed by index, so parameter names are stable across layouts
  and a pipeline stage is this model with the layers it does not own deleted;
- the embedding, final norm and output head may be ``None`` (pass-through) for pipeline stages;
- attention reshapes with ``-1`` heads, so tensor parallelism can shard heads;
- the attention kernel is a parameter-free submodule (``Attention.core``) that context parallelism
  swaps for ring attention;
- ``forward`` takes explicit ``positions`` so a context-parallel shard rotates with its true offsets;
- ``forward`` is ``head(hidden(...))``, so the inference engine runs the same two pieces (the layers
  over its flat token stream, the head over the rows it samples) rather than a second forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.models.flavors import TransformerArgs
from stalwart.models.fused import back_to_back, plain_weights, project_qkv, swiglu
from stalwart.models.moe import MoE, Routing


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """cos/sin tables, shape (max_seq_len, head_dim // 2, 2). Real-valued so DTensor handles them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    t = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(t, inv_freq)  # (seq, head_dim/2)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


@torch.no_grad()
def pack_fused_weights(model: nn.Module) -> None:
    """Lay each attention's q/k/v weights, and each feed-forward's gate and up weights, back to back
    in one tensor (the parameters stay the same objects, their data views of it), so inference's
    ``fused.fused_linear`` reads them in place. Values, and so outputs, are unchanged."""
    for module in model.modules():
        groups = ((module.wq, module.wk, module.wv) if isinstance(module, Attention)
                  else (module.w1, module.w3) if isinstance(module, FeedForward) else ())
        weights = [lin.weight for lin in groups]
        if not weights or not plain_weights(*weights) or back_to_back(weights) is not None:
            continue
        packed = torch.cat([w.detach() for w in weights])
        for w, part in zip(weights, packed.split([w.shape[0] for w in weights])):
            w.data = part


def sliding_window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean mask (q, k): True where query may attend key (causal, and within `window` if > 0)."""
    diff = q_pos.unsqueeze(-1) - k_pos.unsqueeze(0)
    allowed = diff >= 0
    if window > 0:
        allowed &= diff < window
    return allowed


class CoreAttention(nn.Module):
    """softmax(QK^T/sqrt(d))V with a causal (optionally sliding-window) mask. No parameters.

    q: (batch, heads, seq, head_dim); k, v: (batch, kv_heads, seq, head_dim).
    """

    def __init__(self, sliding_window: int = 0) -> None:
        super().__init__()
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # positions: (seq,) absolute positions of these queries and keys.
        gqa = q.shape[1] != k.shape[1]
        if self.sliding_window <= 0 or self.sliding_window >= q.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        mask = sliding_window_mask(positions, positions, self.sliding_window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.core = CoreAttention(args.sliding_window)

    def forward(self, x: torch.Tensor, rope_table: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        bs, seq, _ = x.shape
        # Positions default to 0..seq-1 of the sequence as seen *here* (after a sequence-parallel
        # all-gather it is the full sequence); context parallelism passes its chunks' true offsets.
        if positions is None:
            positions = torch.arange(seq, device=x.device)
        # (batch, seq, heads, head_dim), q and k rotated; -1 heads so a tensor-parallel shard sees its local heads.
        q, k, v = project_qkv(x, (self.wq, self.wk, self.wv), rope_table[positions], self.head_dim)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(x, self.w1, self.w3))


class TransformerBlock(nn.Module):
    """Attention + feed-forward; the feed-forward is dense (``feed_forward``) or sparse (``moe``)."""

    def __init__(self, args: TransformerArgs, layer: int = 0) -> None:
        super().__init__()
        self.parallel = args.parallel_block
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        # The parallel block shares one norm between attention and MLP (GPT-J / MegaScale).
        self.ffn_norm = None if self.parallel else RMSNorm(args.dim, args.norm_eps)
        self.feed_forward: FeedForward | None = None
        self.moe: MoE | None = None
        if args.is_moe_layer(layer):
            m = args.moe
            shared = FeedForward(args.dim, m.hidden * m.n_shared) if m.n_shared else None
            self.moe = MoE(args.dim, m, shared, layer)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None,
                routing: Routing | None = None) -> torch.Tensor:
        ffn = self.feed_forward if self.moe is None else self.moe
        if routing is not None and self.moe is not None:  # a keyword: tensor-parallel input hooks see x only
            ffn = lambda h: self.moe(h, routing=routing)  # noqa: E731
        if self.parallel:
            h = self.attention_norm(x)
            return x + self.attention(h, rope, positions) + ffn(h)
        x = x + self.attention(self.attention_norm(x), rope, positions)
        return x + ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.embed_dim or args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_tables(args.head_dim, args.max_seq_len, args.rope_theta),
                             persistent=False)

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after building on the meta device and materializing)."""
        device = self.rope.device
        self.rope = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=device)
        for block in self.layers.values():
            if block.moe is not None:
                block.moe.reset_buffers()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                routing: Routing | None = None) -> torch.Tensor:
        """tokens: (batch, seq) token ids — or (batch, seq, dim) activations on a later pipeline stage.
        ``routing``: the sparse layers record and/or replay each token's experts (``moe.Routing``).

        Returns logits (batch, seq, vocab) if this model has an output head, else activations.
        """
        return self.head(self.hidden(tokens, positions, routing))

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               routing: Routing | None = None) -> torch.Tensor:
        """The embedding (where present) and the layers: (batch, seq) ids or (batch, seq, dim) activations
        -> (batch, seq, dim) activations. The inference engine runs this over its flat token stream."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope, positions) if routing is None else layer(h, self.rope, positions, routing=routing)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and output head, where present: (..., dim) activations -> (..., vocab) logits
        (activations unchanged on a stage without them). The engine applies it to the rows it samples."""
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def init_spec(self) -> dict[str, tuple[str, float]]:
        """How each parameter is initialised: name -> ('normal', std) | ('ones', 0) | ('zeros', 0).

        Kept as data (not in-place init calls) so the initialiser outside the model can generate each
        full tensor from a per-name seed and copy in whatever shard a rank owns: every parallel layout
        then starts from bit-identical weights.
        """
        std = self.args.init_std
        depth_std = std / math.sqrt(2 * self.args.n_layers)  # residual projections, GPT-2 style
        spec: dict[str, tuple[str, float]] = {}
        for name, _ in self.named_parameters():
            if name.endswith("norm.weight"):
                spec[name] = ("ones", 0.0)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.w2",
                                "shared_experts.w2.weight")):
                spec[name] = ("normal", depth_std)
            else:
                spec[name] = ("normal", std)
        return spec


def count_params(args: TransformerArgs, include_embedding: bool = True, active: bool = False) -> int:
    """Parameter count from the shape alone (no model needed). ``active``: only the parameters one token
    uses (its top-k routed experts and the shared ones, not every expert)."""
    d, f, v = args.dim, args.ffn_hidden, args.vocab_size
    attn = d * args.n_heads * args.head_dim * 2 + d * args.n_kv_heads * args.head_dim * 2
    norms = d * (1 if args.parallel_block else 2)
    layers = 0
    for i in range(args.n_layers):
        if args.is_moe_layer(i):
            m = args.moe
            experts = m.top_k if active else m.n_experts
            ffn = 3 * d * m.hidden * (experts + m.n_shared) + d * m.n_experts  # experts + router
        else:
            ffn = 3 * d * f
        layers += attn + ffn + norms
    embed = v * d
    head = 0 if args.tie_embeddings else (args.embed_dim or v) * d
    return layers + d + head + (embed if include_embedding else 0)


def flops_per_token(args: TransformerArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (non-embedding params incl. the output head) + attention.

    For a mixture of experts the parameters are the *active* ones (top-k routed + shared experts).

    Attention adds 12 * layers * dim * context per token (QK^T and AV, forward 2x + backward 4x),
    the PaLM/torchtitan convention (not halved for causality). With a sliding window the context is
    the window. This is *model* FLOPs: recomputation under activation checkpointing is not counted.
    """
    n = count_params(args, include_embedding=False, active=True)
    if args.tie_embeddings:
        n += args.vocab_size * args.dim  # the tied head still does its matmul
    context = min(seq_len, args.sliding_window) if args.sliding_window else seq_len
    return 6.0 * n + 12.0 * args.n_layers * args.dim * context
