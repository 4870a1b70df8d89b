"""The store interface every backend implements, and the one place that opens a store by address.

A store is an index: chunks with vectors, a BM25 keyword index over their text, metadata, a tenant on
every row. Every read takes the tenant and applies it inside the query (a pre-filter of the vector and
keyword searches), never to results afterwards, so a request scoped to tenant A cannot return, count or
time another tenant's rows. Writes are batches that commit whole or not at all.

Backends: ``lance`` (embedded, the default: a directory) and ``postgres`` (PostgreSQL with pgvector, a
server the user runs), chosen by the address: a path, or ``postgresql://...``.
"""

from __future__ import annotations

from typing import Literal, Protocol

import numpy as np

from stalwart.retrieval.records import Chunk, Hit

Mode = Literal["vector", "keyword", "hybrid"]


class Store(Protocol):
    dim: int                 # vector length this index holds
    embedder: str            # the embedder it was built with ('' = vectors supplied by the user)

    def add(self, chunks: list[Chunk], vectors: np.ndarray) -> None:
        """Commit one batch (vectors: (len(chunks), dim) float32, L2-normalised) whole or not at all."""

    def committed_ids(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` are already in the index (resume of an interrupted ingest)."""

    def delete(self, tenant: str, ids: list[str]) -> int:
        """Delete these ids of this tenant (ids of other tenants are untouched); returns how many."""

    def search(self, tenant: str, *, vector: np.ndarray | None = None, text: str | None = None,
               mode: Mode = "hybrid", k: int = 10, filters: dict | None = None) -> list[Hit]:
        """The top ``k`` of ``tenant``'s chunks (metadata equal to every ``filters`` value)."""

    def count(self, tenant: str) -> int: ...

    def close(self) -> None: ...
