"""Transformer shapes the planner reasons about, and their FLOPs per token.

Defined here rather than imported from stalwart.models so the planner stays a pure calculator that
never imports torch. The Llama 3 shapes are the published ones (Llama 3.2 1B, Llama 3.1 8B/70B/405B); the
sparse ones follow ``stalwart.models.flavors`` (Mixtral 8x7B, and DeepSeek-V3 / Qwen3-30B-A3B expert
layouts with grouped-query attention).

A mixture-of-experts shape has ``n_experts`` routed SwiGLU experts of ``expert_hidden`` per sparse layer
(the first ``n_dense_layers`` keep the dense ``ffn_hidden``), of which a token uses ``top_k`` plus
``n_shared`` shared ones: *total* parameters count every expert, *active* ones what a token computes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    tie_embeddings: bool = False
    n_experts: int = 0                 # routed experts per sparse layer (0 = dense)
    top_k: int = 0
    expert_hidden: int = 0
    n_shared: int = 0
    n_dense_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def n_sparse_layers(self) -> int:
        return self.n_layers - self.n_dense_layers if self.is_moe else 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def dense_layer_params(self) -> int:
        """Attention (q, k, v, o) + SwiGLU (w1, w2, w3) + two RMSNorm weights."""
        h = self.dim
        return h * (h + 2 * self.kv_dim) + h * h + 3 * h * self.ffn_hidden + 2 * h

    def _sparse_layer(self, experts: int) -> int:
        """A sparse layer with ``experts`` routed experts counted (+ router and shared experts)."""
        h = self.dim
        attn = h * (h + 2 * self.kv_dim) + h * h + 2 * h
        return attn + h * self.n_experts + 3 * h * self.expert_hidden * (experts + self.n_shared)

    @property
    def expert_params(self) -> int:
        """Routed-expert parameters of the whole model (sharded by expert parallelism)."""
        return self.n_sparse_layers * 3 * self.dim * self.expert_hidden * self.n_experts

    @property
    def layer_params(self) -> float:
        """Per-layer parameters other than routed experts, averaged over the layers (dense: exact)."""
        if not self.is_moe:
            return self.dense_layer_params
        return (self.n_dense_layers * self.dense_layer_params
                + self.n_sparse_layers * self._sparse_layer(0)) / self.n_layers

    def _layers_total(self, experts: int) -> int:
        if not self.is_moe:
            return self.n_layers * self.dense_layer_params
        return self.n_dense_layers * self.dense_layer_params + self.n_sparse_layers * self._sparse_layer(experts)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def head_params(self) -> int:
        """Output projection + final norm (the projection is shared when embeddings are tied)."""
        return (0 if self.tie_embeddings else self.vocab_size * self.dim) + self.dim

    @property
    def params(self) -> int:
        """Total parameters (every expert)."""
        return self._layers_total(self.n_experts) + self.embedding_params + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters one token computes with (its top-k experts, not all of them)."""
        return self._layers_total(self.top_k) + self.embedding_params + self.head_params

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, torchtitan's convention: 6 * (active params - embedding) + 12 * L * dim * seq.

        NOTE: the attention term counts the full (non-causal) score matrix, as torchtitan's MFU does;
        the cost model charges only the causal half actually computed.
        """
        dense = self.active_params - self.embedding_params
        if self.tie_embeddings:
            dense += self.embedding_params      # the tied matrix still does the output projection
        return 6.0 * dense + 12.0 * self.n_layers * self.dim * seq_len


FLAVORS: dict[str, ModelShape] = {
    "llama3-1B": ModelShape(2048, 16, 32, 8, 8192, 128256, tie_embeddings=True),
    "llama3-8B": ModelShape(4096, 32, 32, 8, 14336, 128256),
    "llama3-70B": ModelShape(8192, 80, 64, 8, 28672, 128256),
    "llama3-405B": ModelShape(16384, 126, 128, 8, 53248, 128256),
    "mixtral-8x7B": ModelShape(4096, 32, 32, 8, 14336, 32000, n_experts=8, top_k=2, expert_hidden=14336),
    "deepseek-v3-like": ModelShape(7168, 61, 128, 128, 18432, 129280, n_experts=256, top_k=8, expert_hidden=2048,
                                   n_shared=1, n_dense_layers=3),
    "qwen3-moe-30B-A3B-like": ModelShape(2048, 48, 16, 4, 6144, 151936, n_experts=128, top_k=8,
                                         expert_hidden=768),
}
