"""The run's data from the ``data`` config section: tokenizer, training loader and validation set.

``data.path`` is either a prepared dataset (``stalwart data prepare``) or text, which the first rank
tokenizes once into the machine's data cache (``stalwart.data.cache``: shared by every run of the same
text, settings and tokenizer) and links as ``<run>/data`` (kept for resumes). A run directory from
before the cache, whose ``data`` is a folder, keeps using it. Either way every rank then reads only its
own sequences from the shards.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from stalwart.data.cache import cache_root, cached, data_key, link_run_data
from stalwart.data.corpus import Corpus, DataError
from stalwart.data.loader import Batch, DataLoader, validation_batches
from stalwart.data.mixture import parse_mix
from stalwart.data.prepare import Source, parse_inputs, prepare, tokenizer_sha256
from stalwart.data.prepared import Prepared, is_prepared, open_prepared
from stalwart.data.tokenizer import eos_id, load_tokenizer, run_tokenizer
from stalwart.ft.records import mark_startup
from stalwart.paths import RunPaths


SHARD_MB = 8.0  # text per shard of a run's own data (the default of `stalwart data prepare`)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@dataclass
class RunData:
    tokenizer: object
    eos: int
    prepared: Prepared
    source: str  # in words, for the banner
    timing: dict = field(default_factory=dict)  # the first rank's start-up work: seconds per part, cache use

    def loader(self, cfg, seq_len: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
               seed: int) -> DataLoader:
        names = self.prepared.names
        weights = parse_mix(cfg.mix, names) if cfg.mix else [t / sum(self.prepared.train_tokens())
                                                               for t in self.prepared.train_tokens()]
        return DataLoader(self.prepared.split("train"), names, weights, seq_len, global_batch, micro_batch,
                          dp_rank, dp_size, seed, prefetch=cfg.prefetch, pairs=self.pairs(seq_len))

    def pairs(self, seq_len: int) -> tuple[int, int] | None:
        """(half, end token) when the data is a pairs dataset (``stalwart data pairs``), else None."""
        half = self.prepared.index.get("pairs", {}).get("half", 0)
        if not half:
            return None
        if seq_len != 2 * half:
            raise DataError(f"data.seq_len is {seq_len}, but {self.prepared.root} holds pairs of {half} + {half} "
                            f"tokens: set --data.seq_len {2 * half}")
        return half, self.prepared.index["eos_id"]

    def validation(self, loader: DataLoader, n_sequences: int, micro_batch: int, dp_rank: int,
                   dp_size: int) -> list[Batch]:
        return validation_batches(self.prepared.split("val"), loader.weights, loader.seq_len, n_sequences,
                                  micro_batch, dp_rank, dp_size, loader.pairs)


def build_run_data(cfg, paths: RunPaths, is_main: bool, init_from_hf: str = "") -> RunData:
    """``cfg`` is the ``data`` section; ``init_from_hf`` is ``checkpoint.init_from_hf`` (whose tokenizer a
    new run adopts). The first rank decides the tokenizer (``run_tokenizer``: the one place that does),
    tokenizes text into ``<run>/data`` or checks the prepared dataset; the others wait, then open what
    it left: the run's tokenizer and the data."""
    given = is_prepared(cfg.path)
    prepared_path = cfg.path if given else str(paths.prepared_data)
    data, timing, clock = None, {}, time.perf_counter()
    if is_main:
        paths.root.mkdir(parents=True, exist_ok=True)
        data = open_prepared(cfg.path) if given else None
        corpus = None if given else Corpus(cfg.path, cfg.format, cfg.text_field, cfg.val_fraction,
                                           cfg.decode_errors, cfg.max_mb)
        clock = _lap(timing, "scan_s", clock)
        tok = run_tokenizer(cfg, paths.tokenizer, data, corpus, init_from_hf,
                            trained=None if given else cache_root(cfg.cache) / "tokenizers")
        clock = _lap(timing, "tokenizer_s", clock)
        if not given:
            timing["cache"] = _prepare_text(cfg, paths, tok, corpus)
            clock = _lap(timing, "prepare_s", clock)
            data = open_prepared(prepared_path)
        data.verify(full=cfg.verify == "full")
        clock = _lap(timing, "verify_s", clock)
    _barrier()
    data = data or open_prepared(prepared_path)
    tok = load_tokenizer(paths.tokenizer)  # every rank reads the one file the first rank decided
    _lap(timing, "open_s", clock)
    mark_startup(paths, "model", data=timing)
    where = (cfg.path or "the bundled corpus (Python standard library)") + (
        f" (its first {cfg.max_mb:g} MB)" if cfg.max_mb and not given else "")
    words = (f"{where} (prepared: {len(data.names)} source(s))" if given
             else f"{where} (tokenized into {_shown(paths.prepared_data)})")
    return RunData(tok, eos_id(tok), data, words, timing)


def _lap(timing: dict, name: str, since: float) -> float:
    now = time.perf_counter()
    timing[name] = round(now - since, 3)
    return now


def _shown(data: Path) -> str:
    return f"{os.readlink(data)}, linked as {data}" if data.is_symlink() else str(data)


def _prepare_text(cfg, paths: RunPaths, tok, corpus: Corpus) -> str:
    """Text into shards: the run's own ``data`` folder if it has one (a run begun before the cache),
    else the machine's cache, linked as ``<run>/data``. Returns how: own, hit, prepared or waited."""
    name = parse_inputs([cfg.path])[0].name
    source = Source(name, os.path.abspath(cfg.path) if cfg.path else "")
    settings = dict(fmt=cfg.format, text_field=cfg.text_field, val_fraction=cfg.val_fraction,
                    decode_errors=cfg.decode_errors)
    own = paths.prepared_data
    if own.is_dir() and not own.is_symlink():
        prepare([source], own, tok, eos_id(tok), corpora=[corpus], out_name="run.dir (its data/ folder)", **settings)
        return "own"
    key = data_key([source], [corpus], tokenizer_sha256(tok), shard_mb=SHARD_MB, **settings)
    entry, how = cached(cache_root(cfg.cache) / "data", key, lambda folder: prepare(
        [source], folder, tok, eos_id(tok), corpora=[corpus], shard_mb=SHARD_MB, out_name="data.cache", **settings))
    link_run_data(own, entry)
    return how
