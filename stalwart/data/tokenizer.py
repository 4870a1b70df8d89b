"""Tokenizers: a byte-level BPE trained on the corpus, or a given tokenizer.json. No hub downloads.

Both 'bpe' and 'byte' produce a Hugging Face `tokenizers.Tokenizer` (byte-level BPE; 'byte' simply
has no merges), so export, generation and loading follow one path.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from stalwart.atomic import write_text_atomic
from stalwart.data.cache import cached_tokenizer
from stalwart.data.corpus import Corpus, DataError
from stalwart.data.prepare import TOKENIZER, tokenizer_sha256
from stalwart.data.prepared import Prepared

EOS = "<|endoftext|>"


def train_bpe(texts: list[str], vocab_size: int, individual_digits: bool = False) -> Tokenizer:
    """A byte-level BPE; ``individual_digits`` keeps every digit its own token (no merges across or
    into digits), so a number reads the same wherever it appears."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if individual_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data.tokenizer: tokenizer file '{p}' does not exist")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(f"data.tokenizer: cannot load '{p}': {e}") from None
    if tok.token_to_id(EOS) is None:
        tok.add_special_tokens([EOS])
    return tok


def train_on(corpora: list[Corpus], vocab_size: int, train_mb: float) -> Tokenizer:
    """A BPE trained on the first ``train_mb`` megabytes of text, shared evenly among the corpora."""
    share = int(train_mb * 1e6 / len(corpora))
    return train_bpe([t for c in corpora for t in c.sample_text(share)], vocab_size)


def run_tokenizer(cfg, cache: Path, prepared: Prepared | None, corpus: Corpus | None,
                  init_from_hf: str = "", trained: Path | None = None) -> Tokenizer:
    """Decide the run's tokenizer, once, on the first rank, and cache it at ``cache`` (``<run>/tokenizer.json``).

    ``cfg`` is the ``data`` section; ``prepared`` the dataset ``data.path`` names, or None for text
    (then ``corpus`` is that text); ``init_from_hf`` is ``checkpoint.init_from_hf``. The tokenizer is
    the first of:

    1. the run's own, ``cache`` (a resume never changes its vocabulary);
    2. the prepared dataset's ``tokenizer.json`` (its tokens are that tokenizer's ids);
    3. ``init_from_hf``'s ``tokenizer.json`` when ``data.tokenizer`` is 'bpe' (the imported embeddings
       are indexed by its ids, so a new BPE would scramble them);
    4. ``data.tokenizer`` given as a path;
    5. a new one trained on the corpus: a byte-level BPE of ``vocab_size`` ('bpe') or bytes only ('byte').

    Every other tokenizer the settings name is checked against it here, each once, and refused by the
    setting that names it: ``init_from_hf``'s against the run's and against ``data.tokenizer``'s, and
    the prepared data's index against the tokenizer the run will use. A new run whose weights come
    from a directory without a tokenizer.json must name its tokenizer ('byte' or a path). NOTE: with
    'byte' no tokenizer is compared with ``init_from_hf``'s; the import's vocabulary-size check backs
    that choice up. ``trained``: a folder of tokenizers trained before on the same corpus and settings
    (``stalwart.data.cache``), used instead of training again.
    """
    cached = load_tokenizer(cache) if cache.is_file() else None
    given = cfg.tokenizer if cfg.tokenizer not in ("bpe", "byte") else ""
    hf, hf_json = _hf_tokenizer(cfg, init_from_hf, cached is not None)
    if hf is not None and cached is not None and tokenizer_sha256(cached) != tokenizer_sha256(hf):
        raise DataError(f"checkpoint.init_from_hf: run directory {cache.parent} already holds a tokenizer.json "
                        f"that differs from {hf_json}, the tokenizer of the weights; choose another --run.dir")
    named = load_tokenizer(given) if given and cached is None else None
    if hf is not None and named is not None and tokenizer_sha256(named) != tokenizer_sha256(hf):
        raise DataError(f"data.tokenizer: {given} differs from {hf_json}, the tokenizer of the weights "
                        "checkpoint.init_from_hf imports; pass that one, or leave data.tokenizer unset to use it")
    adopt_hf = hf is not None and cfg.tokenizer == "bpe"
    if cached is not None:
        if prepared is not None:
            prepared.check_tokenizer(cached, f"run directory {cache.parent}")
        return cached
    if prepared is not None:
        if adopt_hf or named is not None:
            prepared.check_tokenizer(hf if adopt_hf else named,
                                     "checkpoint.init_from_hf" if adopt_hf else "data.tokenizer")
        own = prepared.root / TOKENIZER
        tok = load_tokenizer(own)
        prepared.check_tokenizer(tok, str(own))
    elif adopt_hf or named is not None:
        tok = hf if adopt_hf else named
    else:
        vocab = cfg.vocab_size if cfg.tokenizer == "bpe" else 257
        tok = (cached_tokenizer(trained, corpus, cfg.tokenizer, vocab, cfg.tokenizer_train_mb,
                                lambda: train_on([corpus], vocab, cfg.tokenizer_train_mb))
               if trained is not None else train_on([corpus], vocab, cfg.tokenizer_train_mb))
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(cache, tok.to_str(pretty=True))
    return tok


def _hf_tokenizer(cfg, init_from_hf: str, resuming: bool) -> tuple[Tokenizer | None, Path | None]:
    """(tokenizer, its file) of the Hugging Face directory a run's weights come from, if it has one."""
    if not init_from_hf:
        return None, None
    hf_json = Path(init_from_hf) / "tokenizer.json"
    if not hf_json.is_file():
        if cfg.tokenizer == "bpe" and not resuming:
            raise DataError(f"checkpoint.init_from_hf: {init_from_hf} has no tokenizer.json, and a new BPE would "
                            "not match the imported embeddings; pass the tokenizer the weights were trained with "
                            "as --data.tokenizer PATH")
        return None, None
    try:
        return load_tokenizer(hf_json), hf_json
    except DataError as e:
        raise DataError(f"checkpoint.init_from_hf: {str(e).removeprefix('data.tokenizer: ')}") from None


def eos_id(tok: Tokenizer) -> int:
    idx = tok.token_to_id(EOS)
    assert idx is not None, "tokenizer has no end-of-text token"
    return idx
