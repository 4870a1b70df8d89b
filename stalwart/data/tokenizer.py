"""Tokenizers: a byte-level BPE trained on the corpus, or a given tokenizer.json. No hub downloads.

Both 'bpe' and 'byte' produce a Hugging Face `tokenizers.Tokenizer` (byte-level BPE; 'byte' simply
has no merges), so export, generation and loading follow one path.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from stalwart.atomic import write_text_atomic
from stalwart.data.corpus import Corpus, DataError

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


def build_tokenizer(cfg, corpus: Corpus, cache: Path) -> Tokenizer:
    """Return the run's tokenizer, training it once and caching it at `cache` (the run directory).

    ``cfg`` is the ``data`` config section. The cached file wins on resume, so a run never changes
    its vocabulary midway.
    """
    if cache.is_file():
        return load_tokenizer(cache)
    if cfg.tokenizer in ("bpe", "byte"):
        vocab = cfg.vocab_size if cfg.tokenizer == "bpe" else 257
        tok = train_on([corpus], vocab, cfg.tokenizer_train_mb)
    else:
        tok = load_tokenizer(cfg.tokenizer)
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(cache, tok.to_str(pretty=True))
    return tok


def eos_id(tok: Tokenizer) -> int:
    idx = tok.token_to_id(EOS)
    assert idx is not None, "tokenizer has no end-of-text token"
    return idx
