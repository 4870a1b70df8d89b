"""The run's data from the ``data`` config section: tokenizer, training loader and validation set.

``data.path`` is either a prepared dataset (``stalwart data prepare``) or text, which the first rank
tokenizes once into ``<run>/data`` in the same layout (kept for resumes). Either way every rank then
reads only its own sequences from the shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from stalwart.data.corpus import Corpus
from stalwart.data.loader import Batch, DataLoader, validation_batches
from stalwart.data.mixture import parse_mix
from stalwart.data.prepare import Source, parse_inputs, prepare
from stalwart.data.prepared import Prepared, is_prepared, open_prepared
from stalwart.data.tokenizer import eos_id, load_tokenizer, run_tokenizer
from stalwart.paths import RunPaths


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@dataclass
class RunData:
    tokenizer: object
    eos: int
    prepared: Prepared
    source: str  # in words, for the banner

    def loader(self, cfg, seq_len: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
               seed: int) -> DataLoader:
        names = self.prepared.names
        weights = parse_mix(cfg.mix, names) if cfg.mix else [t / sum(self.prepared.train_tokens())
                                                               for t in self.prepared.train_tokens()]
        return DataLoader(self.prepared.split("train"), names, weights, seq_len, global_batch, micro_batch,
                          dp_rank, dp_size, seed, prefetch=cfg.prefetch)

    def validation(self, loader: DataLoader, n_sequences: int, micro_batch: int, dp_rank: int,
                   dp_size: int) -> list[Batch]:
        return validation_batches(self.prepared.split("val"), loader.weights, loader.seq_len, n_sequences,
                                  micro_batch, dp_rank, dp_size)


def build_run_data(cfg, paths: RunPaths, is_main: bool, init_from_hf: str = "") -> RunData:
    """``cfg`` is the ``data`` section; ``init_from_hf`` is ``checkpoint.init_from_hf`` (whose tokenizer a
    new run adopts). The first rank decides the tokenizer (``run_tokenizer``: the one place that does),
    tokenizes text into ``<run>/data`` or checks the prepared dataset; the others wait, then open what
    it left: the run's tokenizer and the data."""
    given = is_prepared(cfg.path)
    prepared_path = cfg.path if given else str(paths.prepared_data)
    data = None
    if is_main:
        paths.root.mkdir(parents=True, exist_ok=True)
        data = open_prepared(cfg.path) if given else None
        corpus = None if given else Corpus(cfg.path, cfg.format, cfg.text_field, cfg.val_fraction,
                                           cfg.decode_errors)
        tok = run_tokenizer(cfg, paths.tokenizer, data, corpus, init_from_hf)
        if not given:
            source = parse_inputs([cfg.path])[0]
            prepare([Source(source.name, cfg.path)], paths.prepared_data, tok, eos_id(tok), workers=1,
                    fmt=cfg.format, text_field=cfg.text_field, val_fraction=cfg.val_fraction,
                    decode_errors=cfg.decode_errors, corpora=[corpus], out_name="run.dir (its data/ folder)")
            data = open_prepared(prepared_path)
        data.verify(full=cfg.verify == "full")
    _barrier()
    data = data or open_prepared(prepared_path)
    tok = load_tokenizer(paths.tokenizer)  # every rank reads the one file the first rank decided
    where = cfg.path or "the bundled corpus (Python standard library)"
    words = (f"{where} (prepared: {len(data.names)} source(s))" if given
             else f"{where} (tokenized into {paths.prepared_data})")
    return RunData(tok, eos_id(tok), data, words)
