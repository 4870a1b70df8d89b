"""Packed, globally shuffled, mixed and sharded batches from a prepared dataset; exact on resume.

Each source's training split is one token stream (documents each ending in end-of-text, packed with
no padding); its sequence k is tokens [k*L, k*L + L + 1) (inputs and shifted targets). Which
sequences global batch b holds is a pure function of (seed, b) (``mixture.batch_plan``): a seeded
permutation per source and epoch, mixed by weight. Data-parallel rank r reads only its slots
[r*G/dp, (r+1)*G/dp), by positioned reads, so memory does not grow with the corpus and the step's data
does not depend on the number of ranks. The state is the number of batches served. Batches are built
ahead of the step on a background thread (``Prefetcher``), stopped by ``close``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stalwart.data.corpus import DataError
from stalwart.data.pairs import pair_rows
from stalwart.data.mixture import apportion, batch_plan, check_weights, served_per_source
from stalwart.data.prefetch import Prefetcher
from stalwart.data.prepared import TokenArray


@dataclass
class Batch:
    inputs: torch.Tensor  # (micro_batch, seq) int64
    targets: torch.Tensor  # (micro_batch, seq) int64
    routing: object | None = None  # models.moe.Routing the forward replays (RL: the generator's experts)


def _batches(seqs: np.ndarray, micro_batch: int, pairs: tuple[int, int] | None = None) -> list[Batch]:
    t = torch.from_numpy(seqs)  # (n, seq + 1)
    if pairs is not None:  # a pairs dataset: (2 * micro_batch, half) rows and their text masks
        split = [pair_rows(t[i:i + micro_batch], *pairs) for i in range(0, len(seqs), micro_batch)]
        return [Batch(inputs=rows, targets=mask) for rows, mask in split]
    return [Batch(inputs=t[i:i + micro_batch, :-1].contiguous(), targets=t[i:i + micro_batch, 1:].contiguous())
            for i in range(0, len(seqs), micro_batch)]


class DataLoader:
    """Yields, per optimizer step, this rank's list of micro-batches."""

    def __init__(self, streams: list[TokenArray], names: list[str], weights: list[float], seq_len: int,
                 global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int = 0,
                 prefetch: int = 2, pairs: tuple[int, int] | None = None) -> None:
        """``pairs``: (half, end token) of a pairs dataset (``data/pairs.py``), else None."""
        if global_batch % dp_size:
            raise DataError(f"training.global_batch ({global_batch}) is not divisible by the data-parallel "
                            f"size ({dp_size}); choose a multiple of {dp_size}")
        per_rank = global_batch // dp_size
        if per_rank % micro_batch:
            raise DataError(f"each of the {dp_size} data-parallel ranks gets {per_rank} sequences per step, "
                            f"not a multiple of training.micro_batch ({micro_batch}); set training.micro_batch "
                            f"to a divisor of {per_rank}")
        check_weights(weights, names, global_batch)
        self.streams, self.names, self.weights = streams, names, weights
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.dp_rank, self.per_rank, self.seed, self.pairs = dp_rank, per_rank, seed, pairs
        self.accum_steps = per_rank // micro_batch
        self.n_sequences = [max(1, s.tokens // seq_len) for s in streams]
        self.batches_served = 0
        self._prefetch = Prefetcher(self.build, depth=prefetch) if prefetch > 0 else None

    def build(self, b: int) -> list[Batch]:
        """This rank's micro-batches of global batch ``b`` (reads only this rank's sequences)."""
        return self._read(b, slice(self.dp_rank * self.per_rank, (self.dp_rank + 1) * self.per_rank))

    def leaf_batch(self, leaf: int, b: int | None = None) -> Batch:
        """Micro-batch ``leaf`` of global batch ``b`` (default: the one served last), whichever rank
        would read it: a replica group redoes an absent group's micro-batches with it."""
        b = self.batches_served - 1 if b is None else b
        return self._read(b, slice(leaf * self.micro_batch, (leaf + 1) * self.micro_batch))[0]

    def _read(self, b: int, rows: slice) -> list[Batch]:
        src, seq = batch_plan(b, self.global_batch, self.weights, self.n_sequences, self.seed)
        L = self.seq_len
        data = np.stack([self.streams[s].read(int(k) * L, L + 1) for s, k in zip(src[rows], seq[rows])])
        return _batches(data, self.micro_batch, self.pairs)

    def next(self) -> list[Batch]:
        b = self.batches_served
        out = self._prefetch.get(b) if self._prefetch else self.build(b)
        self.batches_served += 1
        return out

    def source_tokens(self) -> dict[str, int]:
        """Training tokens each source has served so far (all ranks together)."""
        served = served_per_source(self.batches_served, self.global_batch, self.weights)
        return {f"data_tokens/{n}": int(c) * self.seq_len for n, c in zip(self.names, served)}

    def state_dict(self) -> dict:
        return {"batches_served": self.batches_served, "seq_len": self.seq_len, "global_batch": self.global_batch,
                "seed": self.seed, "sources": list(self.names), "weights": list(self.weights),
                "sequences": list(self.n_sequences)}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        keys = ("seq_len", "global_batch", "seed", "sources", "weights", "sequences")
        if "stream" in state or any(state.get(k) != mine[k] for k in keys):
            diff = ", ".join(f"{k} {state.get(k)!r} -> {mine[k]!r}" for k in keys if state.get(k) != mine[k])
            raise DataError(f"the checkpoint's data position was saved for other data or batch settings "
                            f"({diff or 'an older loader format'}); resume with the same data.path, data.mix, "
                            "data.seq_len, training.global_batch and run.seed to continue exactly")
        self.batches_served = int(state["batches_served"])

    def close(self) -> None:
        if self._prefetch:
            self._prefetch.close()

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def validation_batches(streams: list[TokenArray], weights: list[float], seq_len: int, n_sequences: int,
                       micro_batch: int, dp_rank: int, dp_size: int,
                       pairs: tuple[int, int] | None = None) -> list[Batch]:
    """This rank's share of a fixed validation set of ``n_sequences`` sequences drawn from every source
    (by weight, at least one each when there are enough), spaced evenly over each source's held-out
    stream, so the estimate covers every source and not only its first document."""
    k = len(streams)
    counts = (np.ones(k, dtype=np.int64) + apportion(n_sequences - k, weights) if n_sequences >= k
              else apportion(n_sequences, weights))
    rows = []
    for stream, count in zip(streams, counts):
        stride = max(1, stream.tokens // ((seq_len + 1) * max(1, int(count))))
        rows += [stream.read(i * stride * seq_len, seq_len + 1) for i in range(int(count))]
    per_rank = n_sequences // dp_size
    mine = rows[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return _batches(np.stack(mine), micro_batch, pairs) if mine else []
