"""The controller's data feed: every data-parallel rank's slice of each global batch.

An SPMD worker of data-parallel rank ``d`` reads only its slice of every global batch
(``stalwart.data.loader``). The controller holds one such loader per data-parallel rank over the
run's prepared data and sends actor ``r`` the slice its data-parallel rank would have read, so both
modes train on the same bits. The loaders' position (a handful of integers, equal for all of them) is
the batch reference the journal records: a step's batch is rebuilt from it on replay, and the
position after a step is what the actors' checkpoints hold.
"""

from __future__ import annotations

import numpy as np
import torch

from stalwart.data.loader import Batch, DataLoader
from stalwart.parallel.dims import ParallelDims
from stalwart.paths import RunPaths
from stalwart.train.data_setup import build_run_data


class Feed:
    def __init__(self, cfg, paths: RunPaths, dims: ParallelDims) -> None:
        """``cfg`` the job config (its data, training and run sections are read); the data and the
        tokenizer are the run's (rank 0's actor prepared or checked them)."""
        d, t = cfg.data, cfg.training
        data = build_run_data(d, paths, is_main=False)
        self.loaders: list[DataLoader] = [
            data.loader(d, d.seq_len, t.global_batch, t.micro_batch, r, dims.dp, cfg.run.seed)
            for r in range(dims.dp)]
        self.dims = dims

    def position(self) -> dict:
        return self.loaders[0].state_dict()

    def seek(self, position: dict) -> None:
        for loader in self.loaders:
            loader.load_state_dict(position)

    def next(self) -> list[list[Batch]]:
        """The next global batch: each data-parallel rank's list of micro-batches."""
        return [loader.next() for loader in self.loaders]

    def share(self, batch: list[list[Batch]], rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Actor ``rank``'s micro-batches of a global batch, packed for the wire (:func:`pack`)."""
        return pack(batch[self.dims.dp_rank(rank)])

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()


def pack(micro: list[Batch]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Micro-batches as numpy arrays (views, no copy): Monarch pickles a numpy array about as fast as
    an empty message, a torch tensor costs milliseconds more per call."""
    return [(b.inputs.numpy(), b.targets.numpy()) for b in micro]


def unpack(packed: list[tuple[np.ndarray, np.ndarray]]) -> list[Batch]:
    """The actor's side of :func:`pack`: the same bits as tensors (sharing the arrays' memory)."""
    return [Batch(inputs=torch.from_numpy(x), targets=torch.from_numpy(y)) for x, y in packed]
