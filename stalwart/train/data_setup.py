"""The run's data from the ``data`` config section: tokenizer, training loader and validation set.

``data.path`` is either a prepared dataset (``stalwart data prepare``) or text, which the first rank
tokenizes once into ``<run>/data`` in the same layout (kept for resumes). Either way every rank then
reads only its own sequences from the shards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from stalwart.atomic import write_text_atomic
from stalwart.data.corpus import Corpus, DataError
from stalwart.data.loader import Batch, DataLoader, validation_batches
from stalwart.data.mixture import parse_mix
from stalwart.data.prepare import Source, parse_inputs, prepare, tokenizer_sha256
from stalwart.data.prepared import Prepared, is_prepared, open_prepared
from stalwart.data.tokenizer import build_tokenizer, eos_id, load_tokenizer
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
    new run adopts). The first rank prepares/checks; the others wait, then open."""
    prepared_path = cfg.path if is_prepared(cfg.path) else str(paths.prepared_data)
    if is_main:
        paths.root.mkdir(parents=True, exist_ok=True)
        cfg, chosen_by = _hf_tokenizer(cfg, init_from_hf, paths)
        if is_prepared(cfg.path):
            _adopt_tokenizer(cfg, open_prepared(cfg.path), paths, chosen_by)
        else:
            corpus = Corpus(cfg.path, cfg.format, cfg.text_field, cfg.val_fraction, cfg.decode_errors)
            tok = build_tokenizer(cfg, corpus, paths.tokenizer)
            source = parse_inputs([cfg.path])[0]
            prepare([Source(source.name, cfg.path)], paths.prepared_data, tok, eos_id(tok), workers=1,
                    fmt=cfg.format, text_field=cfg.text_field, val_fraction=cfg.val_fraction,
                    decode_errors=cfg.decode_errors, corpora=[corpus], out_name="run.dir (its data/ folder)")
        data = open_prepared(prepared_path)
        data.verify(full=cfg.verify == "full")
    _barrier()
    data = open_prepared(prepared_path)
    tok = load_tokenizer(paths.tokenizer)
    data.check_tokenizer(tok, "data.tokenizer")
    where = cfg.path or "the bundled corpus (Python standard library)"
    words = (f"{where} (prepared: {len(data.names)} source(s))" if is_prepared(cfg.path)
             else f"{where} (tokenized into {paths.prepared_data})")
    return RunData(tok, eos_id(tok), data, words)


def _hf_tokenizer(cfg, init_from_hf: str, paths: RunPaths) -> tuple[object, str]:
    """(data section, the setting that names the tokenizer) for a run whose weights come from a Hugging
    Face directory: the imported embeddings are indexed by that directory's token ids, so a new run uses
    its tokenizer.json instead of training one, and a tokenizer given by path (or cached in the run
    directory) must be that one."""
    if not init_from_hf:
        return cfg, "data.tokenizer"
    hf_json = Path(init_from_hf) / "tokenizer.json"
    if not hf_json.is_file():
        if cfg.tokenizer == "bpe" and not paths.tokenizer.is_file():
            raise DataError(f"checkpoint.init_from_hf: {init_from_hf} has no tokenizer.json, and a new BPE would "
                            "not match the imported embeddings; pass the tokenizer the weights were trained with "
                            "as --data.tokenizer PATH")
        return cfg, "data.tokenizer"
    try:
        hf_tok = load_tokenizer(hf_json)
    except DataError as e:
        raise DataError(f"checkpoint.init_from_hf: {str(e).removeprefix('data.tokenizer: ')}") from None
    if paths.tokenizer.is_file():
        if tokenizer_sha256(load_tokenizer(paths.tokenizer)) != tokenizer_sha256(hf_tok):
            raise DataError(f"checkpoint.init_from_hf: run directory {paths.root} already holds a tokenizer.json "
                            f"that differs from {hf_json}, the tokenizer of the weights; choose another --run.dir")
        return cfg, "data.tokenizer"
    if cfg.tokenizer == "bpe":
        return dataclasses.replace(cfg, tokenizer=str(hf_json)), "checkpoint.init_from_hf"
    # NOTE: 'byte' is an explicit choice too; the vocabulary-size check of the import backs it up.
    if cfg.tokenizer != "byte" and tokenizer_sha256(load_tokenizer(cfg.tokenizer)) != tokenizer_sha256(hf_tok):
        raise DataError(f"data.tokenizer: {cfg.tokenizer} differs from {hf_json}, the tokenizer of the weights "
                        "checkpoint.init_from_hf imports; pass that one, or leave data.tokenizer unset to use it")
    return cfg, "data.tokenizer"


def _adopt_tokenizer(cfg, data: Prepared, paths: RunPaths, chosen_by: str = "data.tokenizer") -> None:
    """The run uses the tokenizer the data was prepared with: a run's cached one (on resume) or one
    named by data.tokenizer (or adopted from checkpoint.init_from_hf: ``chosen_by``) must be that
    tokenizer."""
    if paths.tokenizer.is_file():
        data.check_tokenizer(load_tokenizer(paths.tokenizer), f"run directory {paths.root}")
        return
    if cfg.tokenizer not in ("bpe", "byte"):
        data.check_tokenizer(load_tokenizer(cfg.tokenizer), chosen_by)
    tok = load_tokenizer(data.root / "tokenizer.json")
    data.check_tokenizer(tok, f"{data.root}/tokenizer.json")
    write_text_atomic(paths.tokenizer, tok.to_str(pretty=True))

