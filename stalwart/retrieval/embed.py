"""The embedder: an embeddings model trained here (``training.objective = contrastive``) turning texts
into unit vectors, in batches, exactly as training pooled them (``models.embedding.pool``).

It loads what inference loads (``infer/load.py``): a run directory, one of its checkpoints, or the
Hugging Face directory ``stalwart export`` wrote. Texts are encoded like the pairs the model trained on
(``data.pairs.encode_text``: at most half the training sequence, then the end token); a batch is padded
with the end token to its longest text, which causal attention never lets an earlier position see.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from stalwart.data.pairs import encode_text, text_mask
from stalwart.errors import UserError
from stalwart.models.embedding import pool
from stalwart.runtime.device import HOST


class Embedder:
    def __init__(self, where: str | Path, batch_size: int = 32, threads: int = 0) -> None:
        from stalwart.infer.load import build_model, read_source, source_from

        loaded = read_source(source_from(where))
        if not loaded.args.embed_dim:
            raise UserError(f"{where} is a language model, not an embeddings model (train one with "
                            "--training.objective contrastive --model.embed_dim N)")
        if loaded.eos_id is None:
            raise UserError(f"{where}: its tokenizer has no end-of-text token")
        if threads:
            torch.set_num_threads(threads)
        self.tokenizer, self.end = loaded.tokenizer, int(loaded.eos_id)
        self.dim, self.args = loaded.args.embed_dim, loaded.args
        self.max_tokens = loaded.args.max_seq_len // 2  # the rows the model trained on: half a pair
        self.batch_size = batch_size
        self.model = build_model(loaded, torch.float32, HOST)
        self.name = f"{Path(where).resolve().name}@{_fingerprint(loaded.state)}"

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [encode_text(self.tokenizer, t, self.max_tokens, self.end) for t in texts]

    @torch.inference_mode()
    def embed_tokens(self, rows: list[list[int]]) -> np.ndarray:
        """Encoded texts -> (n, dim) float32 unit vectors, ``batch_size`` texts per forward. The texts are
        batched shortest first (a stable sort: the same input is batched the same way every time), so
        a forward pads little; the vectors come back in the input's order."""
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        for i in range(0, len(rows), self.batch_size):
            take = order[i:i + self.batch_size]
            batch = torch.full((len(take), max(len(rows[t]) for t in take)), self.end, dtype=torch.int64)
            for j, t in enumerate(take):
                batch[j, :len(rows[t])] = torch.tensor(rows[t], dtype=torch.int64)
            out[take] = pool(self.model(batch), text_mask(batch, self.end)).numpy()
        return out

    def embed(self, texts: list[str]) -> np.ndarray:
        return self.embed_tokens(self.encode(texts)) if texts else np.zeros((0, self.dim), dtype=np.float32)

    def flops(self, tokens: int) -> float:
        """Model FLOPs of a forward over ``tokens`` tokens (2 x parameters per token, attention aside)."""
        from stalwart.models.llama import count_params

        return 2.0 * count_params(self.args, include_embedding=False) * tokens


def _fingerprint(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:12]
