"""Prepare a corpus once: tokenize every source with N worker processes into token shards plus an index.

The output directory holds, per source and split, shards ``SOURCE.SPLIT.NNNNN.bin/.idx`` (Megatron's
layout, see ``shards.py``), a ``NAME.json`` per finished shard (its counts and checksums),
``tokenizer.json``, ``plan.json`` (what is being prepared) and, last, ``index.json``, whose presence
marks a finished dataset. An interrupted run keeps its finished shards and redoes the rest; the same
inputs and tokenizer give the same bytes, whatever the number of workers.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from stalwart.atomic import write_json_atomic, write_text_atomic
from stalwart.data.corpus import Corpus, DataError, DocRef
from stalwart.data.shards import file_sha256, token_dtype, write_shard

INDEX, PLAN, TOKENIZER = "index.json", "plan.json", "tokenizer.json"
FORMAT = "stalwart-prepared/megatron-mmidx-v1"
ENCODE_BATCH_DOCS = 64
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Source:
    name: str
    path: str  # "" = the bundled corpus


@dataclass(frozen=True)
class ShardJob:
    name: str
    source: int
    split: str
    first: int  # documents [first, stop) of the source's split
    stop: int
    text_bytes: int  # their size on disk (estimated for columnar files): a changed input changes the plan


def parse_inputs(inputs: list[str]) -> list[Source]:
    """``--input PATH`` or ``--input NAME=PATH``; a source is named by its path's stem by default."""
    out: list[Source] = []
    for raw in inputs or [""]:
        name, sep, path = raw.partition("=")
        if not sep or "/" in name:
            name, path = "", raw
        name = name or (Path(path.rstrip("/")).stem if path else "stdlib") or "data"
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        if not _NAME.match(name) or any(s.name == name for s in out):
            raise DataError(f"--input: source name '{name}' is used twice or is not a plain name; give "
                            "each input a distinct name as NAME=PATH")
        out.append(Source(name, path))
    return out


def tokenizer_sha256(tok) -> str:
    """The identity of a tokenizer: the hash of its canonical JSON."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def plan_shards(sizes: list[int], shard_bytes: int) -> list[tuple[int, int]]:
    """Cut documents (their text sizes, in order) into runs of at least ``shard_bytes`` (the last may be
    smaller). Deterministic in the sizes only, so workers and resumed runs agree."""
    out, first, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= shard_bytes:
            out.append((first, i + 1))
            first, acc = i + 1, 0
    if first < len(sizes):
        out.append((first, len(sizes)))
    return out


# Set in the parent before workers fork (inherited copy-on-write), or used in-process with one worker.
_WORK: dict = {}


def _encode_job(job: ShardJob) -> dict:
    corpus: Corpus = _WORK["corpora"][job.source]
    tok, eos, dtype, out = _WORK["tokenizer"], _WORK["eos"], _WORK["dtype"], _WORK["out"]
    docs = (corpus.train if job.split == "train" else corpus.val)[job.first:job.stop]
    arrays, text_bytes = [], 0
    for lo in range(0, len(docs), ENCODE_BATCH_DOCS):
        texts = [corpus.read(d) for d in docs[lo:lo + ENCODE_BATCH_DOCS]]
        text_bytes += sum(len(t.encode("utf-8")) for t in texts)
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            arrays.append(np.asarray(enc.ids + [eos], dtype=np.int64))
    entry = write_shard(out / job.name, arrays, dtype)
    entry.update(source=job.source, split=job.split, text_bytes=text_bytes)
    write_json_atomic(out / f"{job.name}.json", entry)
    return entry


def _finished(out: Path, job: ShardJob) -> dict | None:
    """A shard's entry if it was completed and its files still match their checksums."""
    try:
        entry = json.loads((out / f"{job.name}.json").read_text())
        ok = (file_sha256(out / f"{job.name}.bin") == entry["bin_sha256"]
              and file_sha256(out / f"{job.name}.idx") == entry["idx_sha256"])
    except (OSError, ValueError, KeyError):
        return None
    return entry if ok else None


def _size_hints(corpus: Corpus, docs: list[DocRef]) -> list[int]:
    return [corpus.size_hint(d) for d in docs]


def prepare(sources: list[Source], out: Path, tok, eos: int, *, workers: int = 1, fmt: str = "auto",
            text_field: str = "text", val_fraction: float = 0.02, decode_errors: str = "auto",
            shard_mb: float = 8.0, progress: Callable[[dict], None] | None = None,
            corpora: list[Corpus] | None = None, out_name: str = "--out") -> dict:
    """Prepare ``sources`` into ``out``; returns the index. A finished directory of the same inputs and
    tokenizer is returned as it is; one of other inputs is refused. ``corpora``: the sources already
    opened with these settings (saves a second scan); ``out_name`` names ``out`` in errors."""
    corpora = corpora or [Corpus(s.path, fmt, text_field, val_fraction, decode_errors) for s in sources]
    jobs: list[ShardJob] = []
    for i, (src, corpus) in enumerate(zip(sources, corpora)):
        for split, docs in (("train", corpus.train), ("val", corpus.val)):
            sizes = _size_hints(corpus, docs)
            cuts = plan_shards(sizes, int(shard_mb * 1e6))
            jobs += [ShardJob(f"{src.name}.{split}.{k:05d}", i, split, a, b, sum(sizes[a:b]))
                     for k, (a, b) in enumerate(cuts)]
    tok_hash = tokenizer_sha256(tok)
    plan = {"format": FORMAT, "sources": [asdict(s) for s in sources], "tokenizer_sha256": tok_hash,
            "data_format": fmt, "text_field": text_field, "val_fraction": val_fraction,
            "decode_errors": decode_errors, "shard_mb": shard_mb, "shards": [asdict(j) for j in jobs]}
    out.mkdir(parents=True, exist_ok=True)
    if (out / PLAN).is_file():
        if json.loads((out / PLAN).read_text()) != plan:
            raise DataError(f"{out_name}: {out} holds a prepared dataset of other inputs, tokenizer or settings; "
                            f"choose another {out_name} or delete that directory")
        if (out / INDEX).is_file():
            return json.loads((out / INDEX).read_text())
    for stale in out.glob(".*.tmp"):  # a write that was killed midway
        stale.unlink()
    write_json_atomic(out / PLAN, plan)
    write_text_atomic(out / TOKENIZER, tok.to_str(pretty=True))

    entries = {j.name: e for j in jobs if (e := _finished(out, j)) is not None}
    by_name = {j.name: j for j in jobs}
    state = {"shards": len(entries), "shards_total": len(jobs), "tokens": sum(e["tokens"] for e in entries.values()),
             "bytes": sum(by_name[n].text_bytes for n in entries), "bytes_total": sum(j.text_bytes for j in jobs)}
    if progress:
        progress(dict(state))
    todo = [j for j in jobs if j.name not in entries]
    _WORK.update(corpora=corpora, tokenizer=tok, eos=eos, dtype=token_dtype(tok.get_vocab_size()), out=out)
    try:
        for entry in _run(todo, workers):
            entries[entry["name"]] = entry
            state["shards"] += 1
            state["tokens"] += entry["tokens"]
            state["bytes"] += by_name[entry["name"]].text_bytes
            if progress:
                progress(dict(state))
    finally:
        _WORK.clear()
    index = _index(sources, jobs, entries, tok, eos, tok_hash)
    write_json_atomic(out / INDEX, index)
    return index


def _run(todo: list[ShardJob], workers: int):
    """Encode the shards: in this process for one worker, else in forked workers (which inherit the
    corpora and tokenizer; the tokenizer's own threads are turned off in them)."""
    if workers <= 1 or len(todo) <= 1:
        yield from map(_encode_job, todo)
        return
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    pool = multiprocessing.get_context("fork").Pool(min(workers, len(todo)))
    try:
        yield from pool.imap_unordered(_encode_job, todo)
        pool.close()
    finally:
        pool.terminate()
        pool.join()
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _index(sources: list[Source], jobs: list[ShardJob], entries: dict, tok, eos: int, tok_hash: str) -> dict:
    out_sources = []
    for i, src in enumerate(sources):
        splits = {}
        for split in ("train", "val"):
            shards = [{k: v for k, v in entries[j.name].items() if k not in ("source", "split")}
                      for j in jobs if j.source == i and j.split == split]
            splits[split] = {"documents": sum(s["documents"] for s in shards),
                             "tokens": sum(s["tokens"] for s in shards), "shards": shards}
        out_sources.append({"name": src.name, "path": src.path, **splits})
    return {"format": FORMAT, "tokenizer_sha256": tok_hash, "vocab_size": tok.get_vocab_size(), "eos_id": eos,
            "dtype": token_dtype(tok.get_vocab_size()).name, "sources": out_sources}
