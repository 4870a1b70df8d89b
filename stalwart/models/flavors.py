"""Model shapes: tiny ones for tests and CPU runs, and the published Llama 3 shapes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stalwart.errors import UserError


class ModelShapeError(UserError, ValueError):
    """An inconsistent model shape (e.g. dim not divisible by heads)."""


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
    vocab = cfg.vocab_size or vocab_size
    changes["vocab_size"] = 64 * ((vocab + 63) // 64)
    changes["max_seq_len"] = cfg.max_seq_len or seq_len
    changes["parallel_block"] = cfg.parallel_block
    changes["sliding_window"] = cfg.sliding_window
    changes["init_std"] = cfg.init_std
    args = dataclasses.replace(base, **changes)
    args.validate()
    return args
