"""Model shapes: tiny ones for tests and CPU runs, and the published Llama 3 shapes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from stalwart.errors import UserError


class ModelShapeError(UserError, ValueError):
    """An inconsistent model shape (e.g. dim not divisible by heads)."""


@dataclass(frozen=True)
class MoEArgs:
    """A sparse feed-forward: routed experts chosen per token, optional shared experts."""

    n_experts: int
    top_k: int
    hidden: int                      # SwiGLU hidden size of one routed (and one shared) expert
    n_shared: int = 0                # shared experts every token passes through
    n_dense_layers: int = 0          # the first layers keep a dense feed-forward of ``ffn_hidden``
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = True          # renormalise the top-k weights to sum to 1
    route_scale: float = 1.0         # multiply the combine weights (DeepSeek-V3: 2.5)
    aux_loss_coef: float = 0.0       # sequence-wise balance loss weight (0 = off)
    bias_update_rate: float = 0.0    # auxiliary-loss-free balancing step per optimizer step (0 = off)
    grouped_mm: bool = True          # one grouped matmul over experts, else a loop over non-empty experts

    def validate(self, n_layers: int) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise ModelShapeError(f"model.moe_top_k ({self.top_k}) must be between 1 and model.moe_experts "
                                  f"({self.n_experts})")
        if self.n_dense_layers > n_layers:
            raise ModelShapeError(f"model.moe_dense_layers ({self.n_dense_layers}) exceeds model.n_layers "
                                  f"({n_layers})")

    @property
    def active_experts(self) -> int:
        return self.top_k + self.n_shared


@dataclass(frozen=True)
class TransformerArgs:
    """Everything the model needs to build itself; derived from config.model + the tokenizer."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    parallel_block: bool = False
    sliding_window: int = 0
    init_std: float = 0.02
    moe: MoEArgs | None = None  # None: every layer is dense
    # > 0: an embeddings model: the output head projects each position to this many numbers instead of
    # the vocabulary's logits (pooled and normalised by the contrastive objective and the embedder)
    embed_dim: int = 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.n_dense_layers

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        if self.dim % self.n_heads:
            raise ModelShapeError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ModelShapeError(f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads "
                             f"({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ModelShapeError(f"head dimension {self.head_dim} must be even for RoPE")
        if self.moe is not None:
            self.moe.validate(self.n_layers)
        if self.embed_dim and self.tie_embeddings:
            raise ModelShapeError("model.embed_dim > 0 (an embeddings model) needs its own output head: set "
                                  "--model.tie_embeddings false")


def llama_ffn_hidden(dim: int, multiple_of: int, multiplier: float | None = None) -> int:
    """Llama's SwiGLU hidden size: 2/3 of 4*dim, optionally scaled, rounded up to `multiple_of`."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# vocab_size here is the flavor's native vocabulary; a run normally replaces it with its tokenizer's.
FLAVORS: dict[str, TransformerArgs] = {
    "debug": TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                             ffn_hidden=llama_ffn_hidden(64, 32), tie_embeddings=True),
    "tiny": TransformerArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=4096,
                            ffn_hidden=llama_ffn_hidden(256, 64), tie_embeddings=True),
    "small": TransformerArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=8192,
                             ffn_hidden=llama_ffn_hidden(512, 64), tie_embeddings=True),
    "125M": TransformerArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32768,
                            ffn_hidden=llama_ffn_hidden(768, 256), tie_embeddings=True),
    # Llama 3.2 1B / 3B (tied embeddings), Llama 3.1 8B / 70B / 405B.
    "llama3-1B": TransformerArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                 ffn_hidden=8192, rope_theta=500000.0, tie_embeddings=True, max_seq_len=8192),
    "llama3-3B": TransformerArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                                 ffn_hidden=8192, rope_theta=500000.0, tie_embeddings=True, max_seq_len=8192),
    "llama3-8B": TransformerArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                 ffn_hidden=14336, rope_theta=500000.0, max_seq_len=8192),
    "llama3-70B": TransformerArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                                  ffn_hidden=28672, rope_theta=500000.0, max_seq_len=8192),
    "llama3-405B": TransformerArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                                   ffn_hidden=53248, rope_theta=500000.0, max_seq_len=8192),
    # Sparse: the debug MoE has the debug model's active feed-forward width per token (top-2 experts of
    # half its hidden size) and one dense layer in front of three sparse ones.
    "debug-moe": TransformerArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512,
                                 ffn_hidden=llama_ffn_hidden(64, 32), tie_embeddings=True,
                                 moe=MoEArgs(n_experts=8, top_k=2, hidden=llama_ffn_hidden(64, 32) // 2,
                                             n_dense_layers=1)),
    "mixtral-8x7B": TransformerArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                                    ffn_hidden=14336, rope_theta=1e6, max_seq_len=32768,
                                    moe=MoEArgs(n_experts=8, top_k=2, hidden=14336)),
    # DeepSeek-V3's expert layout (256 routed + 1 shared, top-8, sigmoid scores, 3 dense layers) with
    # grouped-query attention standing in for multi-head latent attention.
    "deepseek-v3-like": TransformerArgs(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280,
                                        ffn_hidden=18432, rope_theta=10000.0, max_seq_len=4096,
                                        moe=MoEArgs(n_experts=256, top_k=8, hidden=2048, n_shared=1,
                                                    n_dense_layers=3, score_func="sigmoid", route_scale=2.5,
                                                    bias_update_rate=1e-3)),
    # Qwen3-30B-A3B's expert layout (128 experts, top-8, no shared experts); attention heads chosen so
    # the head dimension is Qwen3's 128.
    "qwen3-moe-30B-A3B-like": TransformerArgs(dim=2048, n_layers=48, n_heads=16, n_kv_heads=4,
                                              vocab_size=151936, ffn_hidden=6144, rope_theta=1e6,
                                              max_seq_len=32768, moe=MoEArgs(n_experts=128, top_k=8, hidden=768)),
}


def resolve_args(cfg, vocab_size: int, seq_len: int) -> TransformerArgs:
    """Apply config.model overrides to a flavor. ``cfg`` is the ``model`` config section."""
    if cfg.flavor not in FLAVORS:
        import difflib

        guess = difflib.get_close_matches(cfg.flavor, list(FLAVORS), n=1)
        hint = f" (did you mean '{guess[0]}'?)" if guess else f"; choose from {', '.join(FLAVORS)}"
        raise ModelShapeError(f"model.flavor: unknown flavor '{cfg.flavor}'{hint}")
    base = FLAVORS[cfg.flavor]
    changes: dict = {}
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads"):
        if getattr(cfg, name):
            changes[name] = getattr(cfg, name)
    if cfg.n_heads and not cfg.n_kv_heads and base.n_kv_heads > cfg.n_heads:
        changes["n_kv_heads"] = cfg.n_heads
    if cfg.ffn_hidden:
        changes["ffn_hidden"] = cfg.ffn_hidden
    elif cfg.dim:
        changes["ffn_hidden"] = llama_ffn_hidden(cfg.dim, 64)
    if cfg.rope_theta:
        changes["rope_theta"] = cfg.rope_theta
    if cfg.tie_embeddings != "auto":
        changes["tie_embeddings"] = cfg.tie_embeddings == "true"
    elif cfg.embed_dim:
        changes["tie_embeddings"] = False  # an embeddings model's head is not the input embedding
    changes["embed_dim"] = cfg.embed_dim
    vocab = cfg.vocab_size or vocab_size
    changes["vocab_size"] = 64 * ((vocab + 63) // 64)
    changes["max_seq_len"] = cfg.max_seq_len or seq_len
    changes["parallel_block"] = cfg.parallel_block
    changes["sliding_window"] = cfg.sliding_window
    changes["init_std"] = cfg.init_std
    changes["moe"] = _resolve_moe(cfg, base.moe, changes.get("ffn_hidden", base.ffn_hidden))
    args = dataclasses.replace(base, **changes)
    args.validate()
    return args


def _resolve_moe(cfg, base: MoEArgs | None, ffn_hidden: int) -> MoEArgs | None:
    """The flavor's MoE shape with ``model.moe_*`` overrides; ``moe_experts > 0`` makes a dense flavor sparse."""
    if base is None and not cfg.moe_experts:
        return None
    if base is None:
        base = MoEArgs(n_experts=cfg.moe_experts, top_k=min(2, cfg.moe_experts), hidden=max(1, ffn_hidden // 2))
    changes: dict = {}
    for field, name in (("n_experts", "moe_experts"), ("top_k", "moe_top_k"), ("hidden", "moe_hidden"),
                        ("n_shared", "moe_shared"), ("n_dense_layers", "moe_dense_layers")):
        value = getattr(cfg, name)
        if value >= 0 if name in ("moe_shared", "moe_dense_layers") else value > 0:
            changes[field] = value
    if cfg.moe_score != "auto":
        changes["score_func"] = cfg.moe_score
    if cfg.moe_aux_loss >= 0:
        changes["aux_loss_coef"] = cfg.moe_aux_loss
    if cfg.moe_bias_rate >= 0:
        changes["bias_update_rate"] = cfg.moe_bias_rate
    changes["grouped_mm"] = cfg.moe_compute == "grouped"
    return dataclasses.replace(base, **changes)
