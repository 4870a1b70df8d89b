"""Crash-safe ingest: chunks from JSON Lines into a store in fixed batches, each one commit.

Batch k is records ``[k*B, (k+1)*B)`` of the input (blank lines are not records), so a re-run of the
same ingest cuts the same batches. Each batch is one ``Store.add`` (one commit: all its rows or none).
Before anything is written, the whole input is read and checked against the index:

- a bad line, or an id twice in the input -> one line naming the file and line(s);
- a supplied vector that is zero or not finite -> one line naming the line;
- an id already in the index with different content (its digest differs) -> one line naming it;
- a batch with some but not all of its ids in the index (a commit is whole, so an interrupted ingest
  cannot leave one; another batch size or an edited input can) -> one line naming the batch.

Batches whose ids are all committed are skipped; the rest are added once each. Vectors come from the
record's ``vector`` when given, else from ``embed_fn(texts)`` (a deterministic embedder), and are
L2-normalised here, so a re-run writes the same vectors bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalwart.retrieval.records import Chunk, IndexError_, parse_chunk

EmbedFn = Callable[[list[str]], np.ndarray]


@dataclass
class IngestReport:
    records: int
    batches: int
    skipped: int      # batches already committed (an earlier run)
    added: int        # batches committed by this run


def digest(c: Chunk) -> str:
    """The chunk as given (id, tenant, text, metadata, supplied vector), hashed: equal digests, same chunk."""
    blob = json.dumps([c.id, c.tenant, c.text, c.meta, c.vector], sort_keys=True, ensure_ascii=True,
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def read_chunks(path: str | Path, dim: int | None) -> tuple[list[Chunk], list[int]]:
    """Every record of a JSONL file, checked (vector length ``dim``, or the first vector's when None), with
    its line number. Ids must be unique within the file."""
    p = Path(path)
    if not p.is_file():
        raise IndexError_(f"--chunks: {p} is not a file")
    chunks, lines, seen = [], [], {}
    with p.open(encoding="utf-8", errors="strict") as fh:
        try:
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                c = parse_chunk(line, f"{p}:{n}", dim)
                if dim is None and c.vector is not None:
                    dim = len(c.vector)  # no index yet: the first vector sets the length the rest must have
                if c.id in seen:
                    raise IndexError_(f"{p}:{n}: id {c.id[:60]!r} is also on line {seen[c.id]}; ids must be unique")
                seen[c.id] = n
                chunks.append(c)
                lines.append(n)
        except UnicodeDecodeError:
            raise IndexError_(f"{p}: not UTF-8 text (after line {len(lines)})") from None
    return chunks, lines


def normalised(vectors: np.ndarray, ids: list[str]) -> np.ndarray:
    v = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    bad = np.flatnonzero(~np.isfinite(norms[:, 0]) | (norms[:, 0] == 0))
    if bad.size:
        raise IndexError_(f"chunk {ids[bad[0]][:60]!r}: its vector is zero or not finite")
    return np.ascontiguousarray(v / norms, dtype=np.float32)


def batch_vectors(batch: list[Chunk], dim: int, embed_fn: EmbedFn | None) -> np.ndarray:
    """(len(batch), dim) float32, L2-normalised: supplied vectors, the embedder's for the rest."""
    out = np.zeros((len(batch), dim), dtype=np.float32)
    missing = [i for i, c in enumerate(batch) if c.vector is None]
    for i, c in enumerate(batch):
        if c.vector is not None:
            out[i] = np.asarray(c.vector, dtype=np.float32)
    if missing:
        if embed_fn is None:
            raise IndexError_(f"chunk {batch[missing[0]].id[:60]!r} has no 'vector' and the index has no embedder; "
                              "give vectors, or build the index with --embedder")
        emb = np.asarray(embed_fn([batch[i].text for i in missing]), dtype=np.float32)
        if emb.shape != (len(missing), dim):
            raise IndexError_(f"the embedder returned shape {emb.shape}; this index holds vectors of length {dim}")
        out[missing] = emb
    return normalised(out, [c.id for c in batch])


def plan(store, chunks: list[Chunk], lines: list[int], batch: int, where: str) -> list[int]:
    """The batches still to add; raises (one line) on a changed chunk or a partly committed batch."""
    ids = [c.id for c in chunks]
    if hasattr(store, "committed_digests"):
        have = store.committed_digests(ids)
    else:  # a backend without digests: presence only
        have = dict.fromkeys(store.committed_ids(ids))
    for c, n in zip(chunks, lines):
        if c.vector is not None:
            norm = float(np.linalg.norm(np.asarray(c.vector, dtype=np.float32)))
            if not np.isfinite(norm) or norm == 0:
                raise IndexError_(f"{where}:{n}: chunk {c.id[:60]!r}: its vector is zero or not finite")
        d = have.get(c.id, "")
        if d and d != digest(c):
            raise IndexError_(f"{where}:{n}: id {c.id[:60]!r} is already in the index with different content; "
                              "delete it first or give it another id")
    todo = []
    for k in range(0, (len(chunks) + batch - 1) // batch):
        part = ids[k * batch:(k + 1) * batch]
        present = sum(1 for i in part if i in have)
        if present == 0:
            todo.append(k)
        elif present < len(part):
            raise IndexError_(f"batch {k} (records {k * batch}-{k * batch + len(part) - 1}, lines "
                              f"{lines[k * batch]}-{lines[k * batch + len(part) - 1]}) is partly in the index "
                              f"({present} of {len(part)} ids): was it ingested with another --batch or an edited "
                              "file? Re-run with the same file and --batch")
    return todo


def ingest(store, chunks: list[Chunk], lines: list[int], *, batch: int = 1024, embed_fn: EmbedFn | None = None,
           where: str = "input", on_commit: Callable[[int, int], None] | None = None) -> IngestReport:
    """Add ``chunks`` (from :func:`read_chunks`) to ``store``: every check first, then one commit per batch
    still missing. ``on_commit(k, n)`` is called after batch ``k`` (``n`` rows) is committed."""
    if batch < 1:
        raise IndexError_(f"--batch must be at least 1 (got {batch})")
    todo = plan(store, chunks, lines, batch, where)
    nbatches = (len(chunks) + batch - 1) // batch
    for k in todo:
        part = chunks[k * batch:(k + 1) * batch]
        vectors = batch_vectors(part, store.dim, embed_fn)
        store.add(part, vectors)
        if on_commit is not None:
            on_commit(k, len(part))
    return IngestReport(records=len(chunks), batches=nbatches, skipped=nbatches - len(todo), added=len(todo))
