"""Prepared text shared between runs: ``<cache>/data/<key>/``, keyed by everything that defines it.

Text given as ``data.path`` (or the bundled corpus) is tokenized into shards once per machine, not
once per run directory. The key is the sha256 of what decides the bytes: the format version, each
source's name, every input file's absolute path, size and modification time, the reading settings
(format, text field, validation fraction, decoding, shard size) and the tokenizer's sha256. A run
directory's ``data`` is then a symbolic link to its entry, so a resume finds the data it trained on.

Preparing is atomic and happens once, however many processes ask at the same time: the preparer
holds ``<key>.lock`` (``flock``, released by the kernel however its holder dies) and builds into
``.<key>.partial``, which only a complete build leaves, by one rename, as ``<key>``. A waiter blocks on
the lock, then finds the entry ready and reuses it. A half-written entry is never used: the name
``<key>`` exists only complete; a killed preparer's ``.partial`` is resumed (finished shards whose
checksums still match are kept) by the next one.

A tokenizer the run trains on the corpus (``data.tokenizer = 'bpe'`` or 'byte') is kept the same way,
as ``<cache>/tokenizers/<key>.json``, keyed by the corpus's files, the kind, the vocabulary size and
the training text's size: a new run of the same corpus reuses it instead of training it again (the
training is deterministic, so this saves only time). It is written atomically; two runs training it at
once write the same bytes.

Where: ``data.cache`` if set, else ``$STALWART_CACHE``, else ``$XDG_CACHE_HOME/stalwart``, else
``~/.cache/stalwart``; entries are under its ``data/`` folder. Nothing is evicted: delete an entry
(or the folder) to reclaim the space; a run whose entry is gone prepares it again, bit for bit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from stalwart.atomic import fsync_dir, write_text_atomic
from stalwart.data.corpus import Corpus, DataError
from stalwart.data.prepare import FORMAT, INDEX, Source

CACHE_ENV = "STALWART_CACHE"


def cache_root(setting: str = "") -> Path:
    """The cache folder: the setting, ``$STALWART_CACHE``, ``$XDG_CACHE_HOME/stalwart`` or ``~/.cache/stalwart``."""
    if setting:
        return Path(setting).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "stalwart"


def _fingerprint(corpus: Corpus) -> list[list]:
    """Every input file of a corpus: absolute path, size, modification time (ns)."""
    out = []
    for path in sorted({d.path for d in corpus.train + corpus.val}):
        st = os.stat(path)
        out.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
    return out


def data_key(sources: list[Source], corpora: list[Corpus], tokenizer_sha256: str, *, fmt: str, text_field: str,
             val_fraction: float, decode_errors: str, shard_mb: float) -> str:
    """The cache key of text prepared with these inputs, settings and tokenizer (hex sha256)."""
    spec = {"format": FORMAT, "sources": [s.name for s in sources], "files": [_fingerprint(c) for c in corpora],
            "data_format": fmt, "text_field": text_field, "val_fraction": val_fraction,
            "decode_errors": decode_errors, "shard_mb": shard_mb, "tokenizer_sha256": tokenizer_sha256}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another process prepares this entry
        yield
    finally:
        os.close(fd)  # releases the lock


def cached(root: Path, key: str, build: Callable[[Path], object]) -> tuple[Path, str]:
    """The complete entry ``root/<key>``, prepared by ``build(folder)`` if no process has yet.

    Returns (entry, how): 'hit' (it was there), 'prepared' (this call built it) or 'waited' (another
    process was building it; this one waited for it)."""
    entry = root / key
    if (entry / INDEX).is_file():
        return entry, "hit"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.cache: cannot create the data cache {root} ({e.strerror}); set data.cache or "
                        f"${CACHE_ENV} to a writable folder") from None
    with _locked(root / f"{key}.lock"):
        if (entry / INDEX).is_file():
            return entry, "waited"
        if entry.exists():  # not ours and not complete (no index): never used, replaced
            shutil.rmtree(entry)
        partial = root / f".{key}.partial"
        build(partial)
        if not (partial / INDEX).is_file():
            raise RuntimeError(f"preparing {partial} left no {INDEX}")
        os.rename(partial, entry)
        fsync_dir(root)
    return entry, "prepared"


def link_run_data(link: Path, entry: Path) -> None:
    """Point the run directory's ``data`` at a cache entry, refusing a run whose text has changed.

    A run trains on one dataset for its whole life: an existing link to an entry of another key means
    the text, settings or tokenizer changed since the run began, which would break its resume."""
    if link.is_symlink():
        had = Path(os.readlink(link)).name
        if had == entry.name:
            if link.resolve() == entry.resolve():
                return
        else:
            raise DataError(f"data.path: the text this run was prepared from has changed since it began (its data "
                            f"was {had[:12]}, the inputs now give {entry.name[:12]}: a file added, removed or "
                            f"modified, or another reading setting); restore the inputs or choose another --run.dir")
    tmp = link.with_name(f".{link.name}.link")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(entry, tmp)
    os.replace(tmp, link)


def cached_tokenizer(root: Path, corpus: Corpus, kind: str, vocab_size: int, train_mb: float,
                     train: Callable[[], object]):
    """The tokenizer ``train()`` gives for this corpus and settings, from ``root/<key>.json`` when a run
    trained it before (else trained now and kept there)."""
    from tokenizers import Tokenizer

    spec = {"tokenizer": kind, "vocab_size": vocab_size, "train_mb": train_mb, "files": _fingerprint(corpus)}
    path = root / f"{hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()}.json"
    if path.is_file():
        with contextlib.suppress(Exception):  # unreadable: trained again and rewritten
            return Tokenizer.from_file(str(path))
    tok = train()
    with contextlib.suppress(OSError):  # a cache that cannot be written only costs the time
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, tok.to_str(pretty=True), durable=False)
    return tok
