"""Open a store by its address: a directory -> the embedded LanceDB store; ``postgresql://...`` -> the
PostgreSQL + pgvector store (imported only then). Both take the same keywords:

- ``create``: make a new index (``dim`` required; a LanceDB directory must be missing or empty);
- ``dim``: the vector length (checked against the index when opening an existing one);
- ``embedder`` / ``embedder_dir``: the embedder's name and model directory recorded at creation.
"""

from __future__ import annotations

from stalwart.retrieval.records import IndexError_
from stalwart.retrieval.store import Store


def is_postgres(address: str) -> bool:
    return address.startswith(("postgresql://", "postgres://"))


def open_store(address: str, *, dim: int | None = None, embedder: str = "", embedder_dir: str = "",
               create: bool = False) -> Store:
    if not isinstance(address, str) or not address:
        raise IndexError_("an index address is a directory or a postgresql:// URL")
    kw = {"dim": dim, "embedder": embedder, "embedder_dir": embedder_dir, "create": create}
    if is_postgres(address):
        from stalwart.retrieval.pgvector import PgStore

        return PgStore(address, **kw)
    if "://" in address:
        raise IndexError_(f"{address[:60]!r}: unknown store address (a directory, or postgresql://...)")
    from stalwart.retrieval.lance import LanceStore

    return LanceStore(address, **kw)
