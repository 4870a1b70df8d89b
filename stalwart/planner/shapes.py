"""Transformer shapes the planner reasons about, and their FLOPs per token.

Defined here rather than imported from stalwart.models so the planner stays a pure calculator that
never imports torch. The Llama 3 shapes are the published ones (Llama 3.2 1B, Llama 3.1 8B/70B/405B).
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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Attention (q, k, v, o) + SwiGLU (w1, w2, w3) + two RMSNorm weights."""
        h = self.dim
        return h * (h + 2 * self.kv_dim) + h * h + 3 * h * self.ffn_hidden + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def head_params(self) -> int:
        """Output projection + final norm (the projection is shared when embeddings are tied)."""
        return (0 if self.tie_embeddings else self.vocab_size * self.dim) + self.dim

    @property
    def params(self) -> int:
        return self.n_layers * self.layer_params + self.embedding_params + self.head_params

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, torchtitan's convention: 6 * (params - embedding) + 12 * L * dim * seq.

        NOTE: the attention term counts the full (non-causal) score matrix, as torchtitan's MFU does;
        the cost model charges only the causal half actually computed.
        """
        dense = self.params - self.embedding_params
        if self.tie_embeddings:
            dense += self.embedding_params      # the tied matrix still does the output projection
        return 6.0 * dense + 12.0 * self.n_layers * self.dim * seq_len


FLAVORS: dict[str, ModelShape] = {
    "llama3-1B": ModelShape(2048, 16, 32, 8, 8192, 128256, tie_embeddings=True),
    "llama3-8B": ModelShape(4096, 32, 32, 8, 14336, 128256),
    "llama3-70B": ModelShape(8192, 80, 64, 8, 28672, 128256),
    "llama3-405B": ModelShape(16384, 126, 128, 8, 53248, 128256),
}
