"""The embedded store: one LanceDB table in a directory, with the index manifest beside it.

``DIR/index.json`` (written atomically) says what the index holds: its vector length, the embedder it was
built with (name and directory; '' when vectors are supplied), the stalwart version that created it, and
the vector index's settings once one is built. ``DIR/db/chunks.lance`` is the table:

    id      string   unique in the index (BTREE index)
    tenant  string   every read filters on it inside the query (BITMAP index)
    text    string   BM25 full-text index (Lance's native inverted index)
    meta    string   the chunk's metadata as JSON, returned with hits
    tags    list<string>  one ``key=<value as JSON>`` per metadata key (LABEL_LIST index): what filters test
                     (stalwart.retrieval.query explains why tags and not columns or a struct)
    digest  string   sha256 of the chunk as given (id, tenant, text, meta, vector): a re-run of an ingest
                     tells "already committed" from "a different chunk under the same id"
    vector  fixed_size_list<float32>[dim], L2-normalised; cosine distance

Every write is one Lance commit (a new table version or nothing). Every read passes the tenant clause as a
pre-filter (``prefilter=True``), so the vector and keyword searches only ever see that tenant's rows. Below
``ANN_MIN_ROWS`` rows the vector search is exact (a flat scan of the tenant's rows); :meth:`build_indexes`
adds a vector index (:class:`AnnParams`) above it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from stalwart.atomic import write_json_atomic
from stalwart.retrieval import query as q
from stalwart.retrieval.ingest import digest
from stalwart.retrieval.records import Chunk, Hit, IndexError_
from stalwart.retrieval.store import Mode

MANIFEST = "index.json"
TABLE = "chunks"
FORMAT = 1
ANN_MIN_ROWS = 10_000   # the default: below this many rows, exact search is fast enough (and exact)
ID_BATCH = 1000         # ids per `id IN (...)` lookup


@dataclass
class AnnParams:
    """The vector index built by :meth:`LanceStore.build_indexes` and how queries probe it. Zeros take the
    kind's defaults for the table's size; ``auto`` (the default) is IVF_RQ from 128 dimensions up and IVF_FLAT
    below, where 1-bit codes lose too much (measured in docs/retrieval.md):

    - ``IVF_HNSW_SQ``: a graph per partition over 8-bit scalar-quantized vectors; partitions of about
      12.5k rows (a graph's build time grows faster than its size), every partition probed (a graph
      search per partition is cheap). The best recall per millisecond here; the slowest to build.
    - ``IVF_RQ``: RaBitQ 1-bit codes, about sqrt(rows)/4 partitions, half of them probed, the top
      ``refine_factor * k`` re-ranked with exact distances. Builds in seconds.
    - ``IVF_PQ``: product quantization (``sub_vectors``, default dim/2), sqrt(rows) partitions, 20 probed,
      refined.
    - ``IVF_FLAT``: full vectors, sqrt(rows)/4 partitions, half probed.
    """
    kind: str = "auto"
    partitions: int = 0
    sub_vectors: int = 0
    nprobes: int = 0
    refine_factor: int = 0

    def resolved(self, rows: int, dim: int) -> AnnParams:
        if self.kind == "auto":
            kind = "IVF_RQ" if dim >= 128 else "IVF_FLAT"
            return AnnParams(kind, self.partitions, self.sub_vectors, self.nprobes,
                             self.refine_factor).resolved(rows, dim)
        root = max(1, int(rows ** 0.5))
        if self.kind == "IVF_HNSW_SQ":
            parts = self.partitions or max(1, rows // 12_500)
            return AnnParams(self.kind, parts, 0, self.nprobes or parts, self.refine_factor)
        if self.kind == "IVF_RQ":
            parts = self.partitions or max(1, root // 4)
            return AnnParams(self.kind, parts, 0, self.nprobes or max(1, parts // 2), self.refine_factor or 10)
        if self.kind == "IVF_PQ":
            sub = self.sub_vectors or (dim // 2 if dim % 2 == 0 else dim)
            return AnnParams(self.kind, self.partitions or root, sub, self.nprobes or 20, self.refine_factor or 10)
        if self.kind == "IVF_FLAT":
            parts = self.partitions or max(1, root // 4)
            return AnnParams(self.kind, parts, 0, self.nprobes or max(1, parts // 2), self.refine_factor)
        raise IndexError_(f"unknown vector index kind {self.kind!r} (one of {', '.join(ANN_KINDS)})")

    def config(self):
        """The lancedb index configuration (cosine distance)."""
        from lancedb import index

        cls = {"IVF_HNSW_SQ": index.HnswSq, "IVF_RQ": index.IvfRq, "IVF_PQ": index.IvfPq,
               "IVF_FLAT": index.IvfFlat}[self.kind]
        kw = {"num_sub_vectors": self.sub_vectors} if self.kind == "IVF_PQ" else {}
        return cls(distance_type="cosine", num_partitions=self.partitions, **kw)


ANN_KINDS = ("auto", "IVF_RQ", "IVF_FLAT", "IVF_HNSW_SQ", "IVF_PQ")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stalwart")
    except PackageNotFoundError:
        return "unknown"


def read_manifest(path: Path) -> dict:
    f = Path(path) / MANIFEST
    if not f.is_file():
        raise IndexError_(f"{path} is not an index (no {MANIFEST}); create one with `stalwart index build`")
    try:
        man = json.loads(f.read_text())
        if man.get("format") != FORMAT or not isinstance(man.get("dim"), int):
            raise ValueError
    except (ValueError, OSError):
        raise IndexError_(f"{f} is not a stalwart index manifest (format {FORMAT})") from None
    return man


class LanceStore:
    """A :class:`stalwart.retrieval.store.Store` on a directory. ``create=True`` makes a new index (the
    directory must be missing or empty; ``dim`` required); otherwise the index must exist."""

    def __init__(self, path: str | Path, *, dim: int | None = None, embedder: str = "", embedder_dir: str = "",
                 create: bool = False) -> None:
        self.path = Path(path)
        if not create:
            read_manifest(self.path)  # a missing index is refused before lancedb's import (about 2 s of CPU)
        import lancedb

        if create:
            if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
                raise IndexError_(f"{self.path} exists and is not an empty directory; give a new directory, or add "
                                  "to that index with `stalwart index add`")
            if not isinstance(dim, int) or not 0 < dim <= 16384:
                raise IndexError_(f"the vector length must be 1-16384 (got {dim})")
            self.path.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path / MANIFEST, {"format": FORMAT, "dim": dim, "embedder": embedder,
                                                     "embedder_dir": embedder_dir, "created_version": _version(),
                                                     "ann": None})
        self.manifest = read_manifest(self.path)
        self.dim: int = self.manifest["dim"]
        self.embedder: str = self.manifest["embedder"]
        self.ann_min_rows: int = self.manifest.get("ann_min_rows", ANN_MIN_ROWS)
        if dim is not None and dim != self.dim:
            raise IndexError_(f"{self.path} holds vectors of length {self.dim}, not {dim}")
        self._threads = None
        self._db = lancedb.connect(str(self.path / "db"))
        # Created on first open (a build that died between the manifest and the table left it missing).
        self._t = self._db.create_table(TABLE, schema=self.schema(self.dim), exist_ok=True)
        if not self._t.list_indices():
            self._scalar_indexes()

    @staticmethod
    def schema(dim: int):
        import pyarrow as pa

        return pa.schema([("id", pa.string()), ("tenant", pa.string()), ("text", pa.string()),
                          ("meta", pa.string()), ("tags", pa.list_(pa.string())), ("digest", pa.string()),
                          ("vector", pa.list_(pa.float32(), dim))])

    def _scalar_indexes(self) -> None:
        from lancedb.index import FTS, BTree, Bitmap, LabelList

        self._t.create_index("tenant", config=Bitmap(), replace=True)
        self._t.create_index("id", config=BTree(), replace=True)
        self._t.create_index("tags", config=LabelList(), replace=True)
        self._t.create_index("text", config=FTS(), replace=True)

    # -- writes ---------------------------------------------------------------------------------------

    def add(self, chunks: list[Chunk], vectors: np.ndarray, digests: list[str] | None = None) -> None:
        import pyarrow as pa

        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.shape != (len(chunks), self.dim):
            raise IndexError_(f"vectors of shape {vectors.shape} for {len(chunks)} chunks; this index holds {self.dim}")
        if digests is None:
            digests = [digest(c) for c in chunks]
        schema = self.schema(self.dim)
        cols = [pa.array([c.id for c in chunks], pa.string()), pa.array([c.tenant for c in chunks], pa.string()),
                pa.array([c.text for c in chunks], pa.string()),
                pa.array([json.dumps(c.meta, sort_keys=True) for c in chunks], pa.string()),
                pa.array([q.meta_tags(c.meta) for c in chunks], pa.list_(pa.string())),
                pa.array(digests, pa.string()),
                pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), self.dim)]
        self._t.add(pa.Table.from_arrays(cols, schema=schema))  # one commit: a new version or nothing

    def delete(self, tenant: str, ids: list[str]) -> int:
        n = 0
        for i in range(0, len(ids), ID_BATCH):
            n += self._t.delete(q.ids_clause(tenant, ids[i:i + ID_BATCH])).num_deleted_rows
        return n

    def set_ann_min_rows(self, rows: int) -> None:
        """From how many rows this index gets a vector index (kept in the manifest for later adds)."""
        self.ann_min_rows = self.manifest["ann_min_rows"] = int(rows)
        write_json_atomic(self.path / MANIFEST, self.manifest)

    def build_indexes(self, ann: AnnParams | None = None, min_rows: int | None = None,
                      rebuild: bool = True) -> dict | None:
        """Bring the indexes up to date with the rows (new rows, deletions), and build the vector index when
        the table holds at least ``min_rows`` rows (default: the index's ``ann_min_rows``; ``rebuild=False``:
        only if there is none yet; new rows join an existing one through optimize). Returns the vector index's
        settings, or None (exact search)."""
        rows = self._t.count_rows()
        min_rows = self.ann_min_rows if min_rows is None else min_rows
        if rows >= min_rows and (rebuild or not self.manifest.get("ann")):
            ann = (ann or AnnParams(**(self.manifest.get("ann") or {}))).resolved(rows, self.dim)
            cfg = ann.config()
            self._t.create_index("vector", config=cfg, replace=True)
            self.manifest["ann"] = asdict(ann)
            write_json_atomic(self.path / MANIFEST, self.manifest)
        self._t.optimize()  # folds new rows into the scalar and FTS indexes; compacts small fragments
        return self.manifest.get("ann")

    # -- reads ----------------------------------------------------------------------------------------

    def committed_digests(self, ids: list[str]) -> dict[str, str]:
        """id -> digest of those of ``ids`` already in the index (any tenant: ids are unique index-wide)."""
        out: dict[str, str] = {}
        for i in range(0, len(ids), ID_BATCH):
            rows = (self._t.search().where(q.any_tenant_ids_clause(ids[i:i + ID_BATCH]))
                    .select(["id", "digest"]).limit(None).to_arrow())
            out.update(zip(rows["id"].to_pylist(), rows["digest"].to_pylist()))
        return out

    def committed_ids(self, ids: list[str]) -> set[str]:
        return set(self.committed_digests(ids))

    def count(self, tenant: str) -> int:
        return self._t.count_rows(q.tenant_clause(tenant))

    def total_rows(self) -> int:
        """Rows of every tenant (the operator's `index stats`, never a tenant's query)."""
        return self._t.count_rows()

    def tenants(self) -> dict[str, int]:
        """tenant -> rows, for the operator's `index stats`."""
        col = self._t.search().select(["tenant"]).limit(None).to_arrow()["tenant"]
        names, counts = np.unique(np.asarray(col.to_pylist(), dtype=object), return_counts=True)
        return {str(n): int(c) for n, c in zip(names, counts)}

    def export_rows(self):
        """Every row (all tenants) as an Arrow table sorted by id, without the derived tags: what a backup,
        or a comparison of two indexes, reads."""
        t = self._t.search().select(["id", "tenant", "text", "meta", "digest", "vector"]).limit(None).to_arrow()
        return t.sort_by("id")

    def version(self) -> int:
        return self._t.version

    def _vector(self, vector: np.ndarray, where: str, k: int) -> list[dict]:
        v = np.asarray(vector, dtype=np.float32).reshape(-1)
        if v.shape != (self.dim,) or not np.all(np.isfinite(v)):
            raise IndexError_(f"the query vector must hold {self.dim} finite numbers (got {v.size})")
        s = self._t.search(v, vector_column_name="vector").distance_type("cosine").where(where, prefilter=True)
        ann = self.manifest.get("ann")
        if ann:
            s = s.nprobes(ann["nprobes"])
            if ann["refine_factor"]:
                s = s.refine_factor(ann["refine_factor"])
        rows = s.select(["id", "tenant", "text", "meta", "_distance"]).limit(k).to_list()
        for r in rows:
            r["score"] = 1.0 - float(r["_distance"])
        return rows

    def _keyword(self, text: str, where: str, k: int) -> list[dict]:
        if not isinstance(text, str) or not text.strip():
            raise IndexError_("a keyword or hybrid search needs query text")
        rows = (self._t.search(text, query_type="fts", fts_columns="text").where(where, prefilter=True)
                .select(["id", "tenant", "text", "meta", "_score"]).limit(k).to_list())
        for r in rows:
            r["score"] = float(r["_score"])
        return rows

    def search(self, tenant: str, *, vector: np.ndarray | None = None, text: str | None = None,
               mode: Mode = "hybrid", k: int = 10, filters: dict | None = None) -> list[Hit]:
        if not isinstance(k, int) or not 0 < k <= 1000:
            raise IndexError_(f"k must be 1-1000 (got {k})")
        where = q.where_clause(tenant, filters)  # the tenant inside both searches' pre-filter
        if mode == "vector":
            rows = self._vector(_need(vector, mode), where, k)
        elif mode == "keyword":
            rows = self._keyword(text, where, k)
        elif mode == "hybrid":
            depth = max(k, 20)
            # The two searches are independent: the keyword one runs on a second thread meanwhile (the
            # work is in LanceDB's native code, outside the GIL).
            keyword = self._pool().submit(self._keyword, text, where, depth)
            try:
                dense = self._vector(_need(vector, mode), where, depth)
            finally:
                sparse = keyword.result()
            by_id = {r["id"]: r for r in sparse + dense}
            rows = []
            for cid, score in q.rrf([[r["id"] for r in dense], [r["id"] for r in sparse]], k):
                rows.append(by_id[cid] | {"score": score})
        else:
            raise IndexError_(f"mode must be vector, keyword or hybrid (got {mode!r})")
        return [Hit(r["id"], r["tenant"], r["text"], r["score"], json.loads(r["meta"])) for r in rows]

    def _pool(self):
        if self._threads is None:
            from concurrent.futures import ThreadPoolExecutor

            self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lance-keyword")
        return self._threads

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown()
            self._threads = None
        self._t = None
        self._db = None


def _need(vector: np.ndarray | None, mode: str) -> np.ndarray:
    if vector is None:
        raise IndexError_(f"a {mode} search needs a query vector (an embedder, or --vector-file)")
    return vector
