"""The controller's data feed: one loader of the global batch, cut into each actor's micro-batches.

An SPMD worker of data-parallel rank ``d`` reads a contiguous slice of every global batch
(``stalwart.data.loader``); here the controller reads the whole global batch once and sends actor
``r`` the slice its data-parallel rank would have read, so both modes train on the same bits. The
loader's position (a handful of integers) is the batch reference the journal records: a step's batch
is rebuilt from it on replay, and the position after a step is what the actors' checkpoints hold.
"""

from __future__ import annotations

import numpy as np
import torch

from stalwart.data.corpus import Corpus
from stalwart.data.loader import Batch, DataLoader, TokenStream
from stalwart.data.tokenizer import eos_id, load_tokenizer
from stalwart.parallel.dims import ParallelDims
from stalwart.paths import RunPaths


class Feed:
    def __init__(self, cfg, paths: RunPaths, dims: ParallelDims) -> None:
        """``cfg`` the job config (its data, training and run sections are read); the tokenizer is the
        run's (rank 0's actor trained or cached it)."""
        d, t = cfg.data, cfg.training
        corpus = Corpus(d.path, d.format, d.text_field, d.val_fraction, d.decode_errors)
        tokenizer = load_tokenizer(paths.tokenizer)
        stream = TokenStream(corpus, corpus.train, tokenizer, eos_id(tokenizer), cfg.run.seed, True)
        self.loader = DataLoader(stream, d.seq_len, t.global_batch, t.micro_batch, 0, 1, d.shuffle_window,
                                 cfg.run.seed)
        self.dims = dims
        self.accum = t.global_batch // dims.dp // t.micro_batch  # micro-batches per data-parallel rank

    def position(self) -> dict:
        return self.loader.state_dict()

    def seek(self, position: dict) -> None:
        self.loader.load_state_dict(position)

    def next(self) -> list[Batch]:
        """The next global batch, as the whole list of micro-batches."""
        return self.loader.next()

    def share(self, micro: list[Batch], rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Actor ``rank``'s micro-batches of a global batch (its data-parallel rank's contiguous slice),
        packed for the wire (:func:`pack`)."""
        d = self.dims.dp_rank(rank)
        return pack(micro[d * self.accum:(d + 1) * self.accum])


def pack(micro: list[Batch]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Micro-batches as numpy arrays (views, no copy): Monarch pickles a numpy array about as fast as
    an empty message, a torch tensor costs milliseconds more per call."""
    return [(b.inputs.numpy(), b.targets.numpy()) for b in micro]


def unpack(packed: list[tuple[np.ndarray, np.ndarray]]) -> list[Batch]:
    """The actor's side of :func:`pack`: the same bits as tensors (sharing the arrays' memory)."""
    return [Batch(inputs=torch.from_numpy(x), targets=torch.from_numpy(y)) for x, y in packed]
