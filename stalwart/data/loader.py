"""Packed, sharded, stateful data loading.

One *global* stream per split, identical on every rank: documents in a seeded order per epoch, each
followed by an end-of-text token, concatenated. Global sequence k is stream[k*L : k*L + L + 1]
(inputs and shifted targets). Sequences are served in a seeded random order within windows of W
consecutive sequences (so one long document does not fill a whole batch), i.e. logical sequence i is
physical sequence w*W + perm_w[i mod W] for window w = i // W. Global batch b is logical sequences
[b*G, (b+1)*G); data-parallel rank r owns the contiguous slice [b*G + r*G/dp, b*G + (r+1)*G/dp), cut
into micro-batches. Hence:
- the sequences a step sees do not depend on the world size (1 process == N processes);
- ranks' shards are disjoint;
- the position is a few integers, saved and restored exactly (no re-reading from the start).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stalwart.data.corpus import Corpus, DataError, DocRef

TOKENIZE_BATCH_DOCS = 32


class TokenStream:
    """The endless concatenation of tokenized documents, materialized lazily from a cursor.

    The buffer holds tokens starting at global stream offset ``base``; fully consumed documents are
    dropped from its front, so memory stays bounded by a few documents plus one batch.
    """

    def __init__(self, corpus: Corpus, docs: list[DocRef], tokenizer, eos: int, seed: int, shuffle: bool) -> None:
        if not docs:
            raise DataError("the data split is empty")
        self.corpus, self.docs, self.tok, self.eos = corpus, docs, tokenizer, eos
        self.seed, self.shuffle = seed, shuffle
        self._order_cache: tuple[int, np.ndarray] | None = None
        self.reset(epoch=0, cursor=0, base=0)

    def reset(self, epoch: int, cursor: int, base: int) -> None:
        # (epoch, cursor) names the next document to tokenize; base is where the buffer starts.
        self.epoch, self.cursor, self.base = epoch, cursor, base
        self.buffer = np.zeros(0, dtype=np.int64)
        # Starts (global offsets) of documents inside the buffer, with their (epoch, cursor).
        self.doc_starts: list[tuple[int, int, int]] = []

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.docs)
            order = (np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(n)
                     if self.shuffle else np.arange(n))
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _extend(self) -> None:
        order = self._order(self.epoch)
        batch = order[self.cursor:self.cursor + TOKENIZE_BATCH_DOCS]
        texts = [self.corpus.read(self.docs[i]) for i in batch]
        encoded = self.tok.encode_batch(texts, add_special_tokens=False)
        pieces = []
        offset = self.base + len(self.buffer)
        for j, enc in enumerate(encoded):
            ids = np.asarray(enc.ids + [self.eos], dtype=np.int64)
            self.doc_starts.append((offset, self.epoch, self.cursor + j))
            offset += len(ids)
            pieces.append(ids)
        self.buffer = np.concatenate([self.buffer, *pieces])
        self.cursor += len(batch)
        if self.cursor >= len(order):
            self.epoch, self.cursor = self.epoch + 1, 0

    def epoch_tokens(self) -> int:
        """Length of one pass over the split's documents (tokenizes the whole first epoch; meant for
        the small validation split, whose stream is never released)."""
        if self.base != 0:
            raise RuntimeError("epoch_tokens() needs a stream whose start was never released")
        while self.epoch == 0:
            self._extend()
        first_of_next = [start for start, epoch, _ in self.doc_starts if epoch == 1]
        return first_of_next[0] if first_of_next else self.base + len(self.buffer)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the global stream. ``start`` must not go backwards past
        data already released with :meth:`release`."""
        if start < self.base:
            raise RuntimeError(f"stream position {start} was already released (buffer starts at {self.base})")
        while self.base + len(self.buffer) < start + length:
            self._extend()
        lo = start - self.base
        return self.buffer[lo:lo + length]

    def release(self, upto: int) -> None:
        """Drop whole documents that end at or before global offset ``upto``."""
        keep = 0
        while keep + 1 < len(self.doc_starts) and self.doc_starts[keep + 1][0] <= upto:
            keep += 1
        if keep:
            new_base = self.doc_starts[keep][0]
            self.buffer = self.buffer[new_base - self.base:]
            self.base = new_base
            del self.doc_starts[:keep]

    def resume_point(self, position: int) -> dict:
        """A compact state from which the stream can be rebuilt to serve ``position`` onwards."""
        self.read(position, 1)
        self.release(position)
        start, epoch, cursor = self.doc_starts[0]
        return {"epoch": epoch, "cursor": cursor, "doc_start": start}

    def restore(self, point: dict) -> None:
        self.reset(point["epoch"], point["cursor"], point["doc_start"])


@dataclass
class Batch:
    inputs: torch.Tensor  # (micro_batch, seq) int64
    targets: torch.Tensor  # (micro_batch, seq) int64


class DataLoader:
    """Yields, per optimizer step, this rank's list of micro-batches. Stateful and exact on resume."""

    def __init__(self, stream: TokenStream, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, shuffle_window: int = 1, seed: int = 0) -> None:
        if global_batch % dp_size:
            raise DataError(f"training.global_batch ({global_batch}) is not divisible by the data-parallel "
                            f"size ({dp_size}); choose a multiple of {dp_size}")
        per_rank = global_batch // dp_size
        if per_rank % micro_batch:
            raise DataError(f"each of the {dp_size} data-parallel ranks gets {per_rank} sequences per step, "
                            f"not a multiple of training.micro_batch ({micro_batch}); set training.micro_batch "
                            f"to a divisor of {per_rank}")
        self.stream, self.seq_len = stream, seq_len
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.per_rank = per_rank
        self.accum_steps = per_rank // micro_batch
        self.batches_served = 0  # global batches consumed
        self.window, self.seed = max(1, shuffle_window), seed
        self._perm: tuple[int, np.ndarray] | None = None

    def _physical(self, i: int) -> int:
        w, offset = divmod(i, self.window)
        if self.window == 1:
            return i
        if self._perm is None or self._perm[0] != w:
            rng = np.random.Generator(np.random.PCG64([self.seed, 7919, w]))
            self._perm = (w, rng.permutation(self.window))
        return w * self.window + int(self._perm[1][offset])

    def _sequence(self, i: int) -> np.ndarray:
        return self.stream.read(self._physical(i) * self.seq_len, self.seq_len + 1)

    def _window_start_tokens(self) -> int:
        """Stream offset of the window holding the next logical sequence: nothing before it is needed."""
        next_seq = self.batches_served * self.global_batch
        return (next_seq // self.window) * self.window * self.seq_len

    def next(self) -> list[Batch]:
        b = self.batches_served
        first = b * self.global_batch + self.dp_rank * self.per_rank
        micro: list[Batch] = []
        for m in range(self.accum_steps):
            seqs = np.stack([self._sequence(first + m * self.micro_batch + i) for i in range(self.micro_batch)])
            t = torch.from_numpy(seqs)
            micro.append(Batch(inputs=t[:, :-1].contiguous(), targets=t[:, 1:].contiguous()))
        self.batches_served += 1
        self.stream.release(self._window_start_tokens())
        return micro

    def state_dict(self) -> dict:
        return {"batches_served": self.batches_served, "seq_len": self.seq_len, "global_batch": self.global_batch,
                "shuffle_window": self.window, "stream": self.stream.resume_point(self._window_start_tokens())}

    def load_state_dict(self, state: dict) -> None:
        saved = (state["seq_len"], state["global_batch"], state.get("shuffle_window", 1))
        if saved != (self.seq_len, self.global_batch, self.window):
            raise DataError(f"the checkpoint's data position was saved with seq_len={saved[0]}, "
                            f"global_batch={saved[1]}, shuffle_window={saved[2]}; this run uses "
                            f"seq_len={self.seq_len}, global_batch={self.global_batch}, "
                            f"shuffle_window={self.window}. Keep them equal to resume exactly.")
        self.batches_served = int(state["batches_served"])
        self.stream.restore(state["stream"])


def validation_batches(stream: TokenStream, seq_len: int, n_sequences: int, micro_batch: int,
                       dp_rank: int, dp_size: int) -> list[Batch]:
    """This rank's share of a fixed validation set of `n_sequences` sequences, spaced evenly over one
    pass of the validation split (so the estimate covers every held-out document, not the first one)."""
    stride = max(1, stream.epoch_tokens() // ((seq_len + 1) * n_sequences))
    per_rank = n_sequences // dp_size
    first = dp_rank * per_rank
    out = []
    for lo in range(0, per_rank, micro_batch):
        n = min(micro_batch, per_rank - lo)
        seqs = np.stack([stream.read((first + lo + i) * stride * seq_len, seq_len + 1) for i in range(n)])
        t = torch.from_numpy(seqs)
        out.append(Batch(inputs=t[:, :-1].contiguous(), targets=t[:, 1:].contiguous()))
    return out
