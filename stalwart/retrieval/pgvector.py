"""The server store: one PostgreSQL table per index, with the pgvector extension, reached by an address.

``postgresql://USER[:PASSWORD]@HOST[:PORT]/DB?table=NAME`` (``table`` defaults to ``chunks``; every other
part is libpq's own, e.g. ``sslmode=require`` or ``host=/run/postgresql`` for a unix socket). The table:

    id      text primary key   unique in the index
    tenant  text not null      every read has ``WHERE tenant = %s`` (a bound parameter)   btree
    text    text               returned with hits
    meta    jsonb              the chunk's metadata; filters are containment ``meta @> ...``  GIN (jsonb_path_ops)
    digest  text               sha256 of the chunk as given (the ingest's re-run check)
    vec     vector(dim)        L2-normalised; cosine distance                              HNSW (vector_cosine_ops)
    tsv     tsvector           ``to_tsvector(ts_config, text)``, the keyword index        GIN
    dl      int                the text's token count (BM25's document length)

``stalwart_indexes`` (name, dim, embedder, embedder_dir, ts_config) says what each table holds.

Keyword ranking is BM25 (k1=1.2, b=0.75) computed in SQL over PostgreSQL's own lexemes: the GIN index
finds the tenant's rows holding any query lexeme, term frequencies come from the tsvector's positions, and
the corpus statistics (rows, mean length, document frequencies) are the *tenant's*, so one tenant's rows
cannot move another's scores. Hybrid search runs both searches, each with the tenant clause, and fuses them
by reciprocal rank fusion (``query.rrf``, k=60). Every write is one transaction: a batch commits whole or
not at all, and a client that dies mid-batch leaves nothing of it (the server rolls the transaction back).
"""

from __future__ import annotations

import json
import re
import threading
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

from stalwart.retrieval import query as q
from stalwart.retrieval.ingest import digest
from stalwart.retrieval.records import MAX_ID, Chunk, Hit, IndexError_, check_meta, check_tenant
from stalwart.retrieval.store import Mode

TABLE_RE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
CATALOG = "stalwart_indexes"
TS_CONFIG = "english"        # PostgreSQL's text search configuration (stemming, stop words) for new indexes
BM25_K1, BM25_B = 1.2, 0.75
MAX_DIM = 2000               # the largest vector pgvector's HNSW index takes
_LOCK = 0x57A1_3A7           # advisory lock key: index creation is serialised across clients


def split_address(address: str) -> tuple[str, str, str]:
    """``postgresql://...?table=T`` -> (libpq conninfo without ``table``, table name, address for messages
    with the password left out)."""
    u = urlsplit(address)
    if u.scheme not in ("postgresql", "postgres"):
        raise IndexError_(f"{address[:60]!r} is not a postgresql:// address")
    params = parse_qsl(u.query, keep_blank_values=True)
    tables = [v for k, v in params if k == "table"]
    table = tables[-1] if tables else "chunks"
    if not TABLE_RE.match(table):
        raise IndexError_(f"table {table[:60]!r} must be 1-48 lowercase letters, digits or '_', starting with a letter")
    rest = urlencode([(k, v) for k, v in params if k != "table"])
    netloc = u.netloc
    shown = netloc.rsplit("@", 1)[-1] if "@" in netloc else netloc
    user = netloc.rsplit("@", 1)[0].split(":", 1)[0] if "@" in netloc else ""
    shown = f"{u.scheme}://{user + '@' if user else ''}{shown}{u.path}?table={table}"
    return urlunsplit((u.scheme, netloc, u.path, rest, "")), table, shown


def _vec(v: np.ndarray) -> str:
    """pgvector's text form; float32 values written with 9 significant digits round-trip exactly."""
    return "[" + ",".join(f"{x:.9g}" for x in v.tolist()) + "]"


def _bm25_sql(table, filters: str):
    from psycopg import sql

    # The OR of the query's lexemes as a tsquery: each lexeme quoted for tsquery input (quote and
    # backslash doubled); a text with no lexemes gives NULL, which matches nothing.
    return sql.SQL(r"""
WITH q AS (
  SELECT array_agg(l) AS lex,
         string_agg('''' || replace(replace(l, '\', '\\'), '''', '''''') || '''', ' | ')::tsquery AS tsq
  FROM unnest(tsvector_to_array(to_tsvector(%(cfg)s::regconfig, %(text)s))) AS l),
stats AS (SELECT count(*)::float8 AS n, coalesce(avg(dl), 0)::float8 AS avgdl FROM {t} WHERE tenant = %(tenant)s),
hits AS (SELECT d.id, d.dl, d.meta, d.tsv FROM {t} d, q WHERE d.tenant = %(tenant)s AND d.tsv @@ q.tsq),
terms AS (SELECT h.id, h.dl, h.meta, u.lexeme, cardinality(u.positions)::float8 AS tf
          FROM hits h CROSS JOIN LATERAL unnest(h.tsv) AS u, q WHERE u.lexeme = ANY(q.lex)),
df AS (SELECT lexeme, count(*)::float8 AS df FROM terms GROUP BY lexeme),
scored AS (
  SELECT t.id, sum(ln(1 + (s.n - df.df + 0.5) / (df.df + 0.5))
                   * t.tf * (%(k1)s + 1) / (t.tf + %(k1)s * (1 - %(b)s + %(b)s * t.dl / greatest(s.avgdl, 1)))) AS score
  FROM terms t JOIN df USING (lexeme) CROSS JOIN stats s
  WHERE true {filters}
  GROUP BY t.id)
SELECT c.id, c.tenant, c.text, c.meta, scored.score FROM scored JOIN {t} c ON c.id = scored.id
WHERE c.tenant = %(tenant)s ORDER BY scored.score DESC, c.id LIMIT %(k)s
""").format(t=table, filters=sql.SQL(filters))


def _filters(filters: dict | None, column: str) -> tuple[str, dict]:
    """Metadata filters as SQL with bound values: one ``meta @> ANY(%(fN)s::jsonb[])`` per key (any of its
    values). Keys and values are checked by ``query.filter_tags`` (the same rules and canonical values as
    every backend); the SQL text holds only this module's own column name and parameter names."""
    parts, params = [], {}
    for n, tags in enumerate(q.filter_tags(filters)):
        docs = []
        for t in tags:
            key, _, value = t.partition("=")
            docs.append(json.dumps({key: json.loads(value)}))
        parts.append(f" AND {column}.meta @> ANY(%(f{n})s::jsonb[])")
        params[f"f{n}"] = docs
    return "".join(parts), params


class PgStore:
    """A :class:`stalwart.retrieval.store.Store` in a PostgreSQL database with pgvector. ``create=True``
    makes a new index (the table must not exist; ``dim`` required); otherwise the index must exist."""

    def __init__(self, address: str, *, dim: int | None = None, embedder: str = "", embedder_dir: str = "",
                 create: bool = False, connect_timeout: int = 10) -> None:
        try:
            import psycopg
            from psycopg import sql
        except ImportError:
            raise IndexError_("a postgresql:// index needs the psycopg client: pip install 'psycopg[binary]'") from None
        self._psycopg, self._sql = psycopg, sql
        self._conninfo, self.table, self.address = split_address(address)
        self._timeout = connect_timeout
        self._t = sql.Identifier(self.table)
        self._lock = threading.Lock()  # one connection: one operation (one transaction) at a time
        self._conn = None
        self._connect()
        try:
            if create:
                self._create(dim, embedder, embedder_dir)
            row = self._catalog()
            if row is None:
                raise IndexError_(f"no index at {self.address}; create one with `stalwart index build`")
            self.dim, self.embedder, self.embedder_dir, self.ts_config, self._iterative = row
            # what the index holds, under the names the embedded store's manifest uses
            self.manifest = {"dim": self.dim, "embedder": self.embedder, "embedder_dir": self.embedder_dir,
                             "ts_config": self.ts_config, "ann": {"kind": "HNSW", "distance": "cosine"}}
            if dim is not None and dim != self.dim:
                raise IndexError_(f"{self.address} holds vectors of length {self.dim}, not {dim}")
        except BaseException:
            self._conn.close()
            raise

    # -- the connection -------------------------------------------------------------------------------

    def _connect(self) -> None:
        psycopg = self._psycopg
        try:
            conn = psycopg.connect(self._conninfo, connect_timeout=self._timeout)
        except psycopg.Error as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise IndexError_(f"cannot connect to PostgreSQL at {self.address}: {msg}") from None
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ  # a search's two queries: one snapshot
        if self._conn is not None:
            self._conn.close()
        self._conn = conn

    def _run(self, fn, *, retry: bool):
        """``fn(conn)`` in one transaction, one at a time. A connection found broken (a server restart, an
        idle connection cut) is reopened first; a read (``retry``) that loses its connection midway runs once
        more on a new one. A write is never re-run here: the ingest's resume check decides what is missing."""
        with self._lock:
            for attempt in (0, 1):
                if self._conn.broken:
                    self._connect()
                try:
                    with self._conn.transaction():
                        return fn(self._conn)
                except self._psycopg.OperationalError as e:
                    if not self._conn.broken:
                        raise
                    if retry and attempt == 0:
                        continue
                    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    raise IndexError_(f"lost the connection to PostgreSQL at {self.address} ({msg})" + (
                        "" if retry else "; a write cut before its commit was acknowledged may or may not have "
                        "committed: run it again (an ingest skips the batches committed)")) from None

    # -- schema ---------------------------------------------------------------------------------------

    def _catalog(self) -> tuple | None:
        def read(c):
            if c.execute("SELECT to_regclass(%s)", [CATALOG]).fetchone()[0] is None:
                return None, None
            row = c.execute(self._sql.SQL("SELECT dim, embedder, embedder_dir, ts_config FROM {} WHERE name = %s")
                            .format(self._sql.Identifier(CATALOG)), [self.table]).fetchone()
            return row, c.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()

        row, ver = self._run(read, retry=True)
        if row is None:
            return None
        # hnsw.iterative_scan (pgvector 0.8): the HNSW scan goes on until k rows pass the tenant clause
        iterative = ver is not None and tuple(int(x) for x in re.findall(r"\d+", ver[0])[:2]) >= (0, 8)
        return (*row, iterative)

    def _create(self, dim: int | None, embedder: str, embedder_dir: str) -> None:
        if not isinstance(dim, int) or isinstance(dim, bool) or not 0 < dim <= MAX_DIM:
            raise IndexError_(f"the vector length must be 1-{MAX_DIM} for pgvector's HNSW index (got {dim})")
        sql, t, psycopg = self._sql, self._t, self._psycopg

        def create(c):
            c.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK])
            c.execute("CREATE EXTENSION IF NOT EXISTS vector")
            c.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (name text PRIMARY KEY, dim int NOT NULL, "
                              "embedder text NOT NULL, embedder_dir text NOT NULL, ts_config text NOT NULL)")
                      .format(sql.Identifier(CATALOG)))
            if c.execute("SELECT to_regclass(%s)", [self.table]).fetchone()[0] is not None:
                raise IndexError_(f"{self.address} exists already; add to it with `stalwart index add`, or "
                                  "give another ?table=")
            c.execute(sql.SQL("CREATE TABLE {t} (id text PRIMARY KEY, tenant text NOT NULL, text text NOT NULL, "
                              "meta jsonb NOT NULL, digest text NOT NULL, vec vector({dim}) NOT NULL, "
                              "tsv tsvector NOT NULL, dl int NOT NULL)").format(t=t, dim=sql.Literal(dim)))
            for suffix, how in (("tenant", "btree (tenant)"), ("vec", "hnsw (vec vector_cosine_ops)"),
                                ("tsv", "gin (tsv)"), ("meta", "gin (meta jsonb_path_ops)")):
                c.execute(sql.SQL("CREATE INDEX {i} ON {t} USING " + how)
                          .format(i=sql.Identifier(f"{self.table}_{suffix}"), t=t))
            # a catalog row left by a table dropped by hand is replaced
            c.execute(sql.SQL("DELETE FROM {} WHERE name = %s").format(sql.Identifier(CATALOG)), [self.table])
            c.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s, %s, %s, %s)").format(sql.Identifier(CATALOG)),
                      [self.table, dim, embedder, embedder_dir, TS_CONFIG])

        try:
            self._run(create, retry=False)
        except psycopg.errors.FeatureNotSupported as e:
            raise IndexError_(f"{self.address}: {str(e).strip().splitlines()[0]}") from None
        except (psycopg.errors.UndefinedFile, psycopg.errors.InsufficientPrivilege) as e:
            raise IndexError_(f"{self.address}: the pgvector extension cannot be created there "
                              f"({str(e).strip().splitlines()[0]}); install pgvector on the server, and have a "
                              "superuser run CREATE EXTENSION vector in that database") from None

    # -- writes ---------------------------------------------------------------------------------------

    def add(self, chunks: list[Chunk], vectors: np.ndarray, digests: list[str] | None = None) -> None:
        """One transaction: every row of the batch, or (an error, a lost client) none of them."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.shape != (len(chunks), self.dim):
            raise IndexError_(f"vectors of shape {vectors.shape} for {len(chunks)} chunks; this index holds {self.dim}")
        if not np.all(np.isfinite(vectors)):
            raise IndexError_("vectors must be finite numbers")
        if digests is None:
            digests = [digest(c) for c in chunks]
        rows = []
        for c, v, d in zip(chunks, vectors, digests):
            if not isinstance(c.id, str) or not c.id or len(c.id) > MAX_ID:
                raise IndexError_(f"chunk id {str(c.id)[:60]!r}: a non-empty string of at most {MAX_ID} characters")
            check_tenant(c.tenant, f"chunk {c.id[:60]!r}: 'tenant'")
            check_meta(c.meta, f"chunk {c.id[:60]!r}")
            rows.append({"id": c.id, "tenant": c.tenant, "text": c.text, "digest": d, "vec": _vec(v),
                         "meta": json.dumps(c.meta, sort_keys=True), "cfg": self.ts_config})
        if not rows:
            return
        stmt = self._sql.SQL(
            "INSERT INTO {t} (id, tenant, text, meta, digest, vec, tsv, dl) "
            "SELECT %(id)s, %(tenant)s, %(text)s, %(meta)s::jsonb, %(digest)s, %(vec)s::vector, v.tsv, "
            "(SELECT coalesce(sum(cardinality(u.positions)), 0) FROM unnest(v.tsv) AS u) "
            "FROM (SELECT to_tsvector(%(cfg)s::regconfig, %(text)s) AS tsv) AS v").format(t=self._t)
        def insert(c):
            with c.cursor() as cur:
                cur.executemany(stmt, rows)

        errors = self._psycopg.errors
        try:
            self._run(insert, retry=False)
        except errors.UniqueViolation as e:
            detail = (e.diag.message_detail or "").strip()
            raise IndexError_(f"{self.address}: a chunk id is already in the index ({detail}); nothing of this "
                              "batch was added") from None
        except (errors.DataError, errors.CharacterNotInRepertoire) as e:
            raise IndexError_(f"{self.address}: a chunk was refused ({str(e).strip().splitlines()[0]}); nothing "
                              "of this batch was added") from None

    def delete(self, tenant: str, ids: list[str]) -> int:
        check_tenant(tenant)
        stmt = self._sql.SQL("DELETE FROM {} WHERE tenant = %s AND id = ANY(%s)").format(self._t)
        return self._run(lambda c: c.execute(stmt, [tenant, list(ids)]).rowcount, retry=False)

    def build_indexes(self, ann=None, min_rows: int = 0) -> dict | None:
        """The indexes are kept up to date by PostgreSQL on every write; this refreshes the planner's
        statistics. Returns the vector index's settings."""
        self._run(lambda c: c.execute(self._sql.SQL("ANALYZE {}").format(self._t)), retry=True)
        return {"kind": "HNSW", "distance": "cosine"}

    # -- reads ----------------------------------------------------------------------------------------

    def _rows(self, stmt, params) -> list[tuple]:
        return self._run(lambda c: c.execute(stmt, params).fetchall(), retry=True)

    def committed_digests(self, ids: list[str]) -> dict[str, str]:
        """id -> digest of those of ``ids`` already in the index (any tenant: ids are unique index-wide)."""
        rows = self._rows(self._sql.SQL("SELECT id, digest FROM {} WHERE id = ANY(%s)").format(self._t), [list(ids)])
        return dict(rows)

    def committed_ids(self, ids: list[str]) -> set[str]:
        return set(self.committed_digests(ids))

    def count(self, tenant: str) -> int:
        check_tenant(tenant)
        return self._rows(self._sql.SQL("SELECT count(*) FROM {} WHERE tenant = %s").format(self._t), [tenant])[0][0]

    def total_rows(self) -> int:
        """Rows of every tenant (the operator's `index stats`, never a tenant's query)."""
        return self._rows(self._sql.SQL("SELECT count(*) FROM {}").format(self._t), [])[0][0]

    def tenants(self) -> dict[str, int]:
        """tenant -> rows, for the operator's `index stats`."""
        rows = self._rows(self._sql.SQL("SELECT tenant, count(*) FROM {} GROUP BY tenant ORDER BY tenant")
                          .format(self._t), [])
        return dict(rows)

    def _vector(self, c, tenant: str, v: np.ndarray, filters: dict | None, k: int) -> list[tuple]:
        where, params = _filters(filters, "c")
        stmt = self._sql.SQL("SELECT c.id, c.tenant, c.text, c.meta, 1 - (c.vec <=> %(q)s::vector) FROM {t} c "
                             "WHERE c.tenant = %(tenant)s" + where + " ORDER BY c.vec <=> %(q)s::vector "
                             "LIMIT %(k)s").format(t=self._t)
        # the HNSW candidate list must be at least k long (ef_search; pgvector's default is 40)
        c.execute("SELECT set_config('hnsw.ef_search', %s, true)", [str(max(40, k))])
        if self._iterative:
            c.execute("SELECT set_config('hnsw.iterative_scan', 'strict_order', true)")
        return c.execute(stmt, params | {"q": _vec(v), "tenant": tenant, "k": k}).fetchall()

    def _keyword(self, c, tenant: str, text: str, filters: dict | None, k: int) -> list[tuple]:
        where, params = _filters(filters, "t")
        params |= {"cfg": self.ts_config, "text": text, "tenant": tenant, "k": k, "k1": BM25_K1, "b": BM25_B}
        return c.execute(_bm25_sql(self._t, where), params).fetchall()

    def search(self, tenant: str, *, vector: np.ndarray | None = None, text: str | None = None,
               mode: Mode = "hybrid", k: int = 10, filters: dict | None = None) -> list[Hit]:
        if not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= 1000:
            raise IndexError_(f"k must be 1-1000 (got {k})")
        if mode not in ("vector", "keyword", "hybrid"):
            raise IndexError_(f"mode must be vector, keyword or hybrid (got {mode!r})")
        check_tenant(tenant)
        q.filter_tags(filters)  # everything is checked before any query runs
        v = None
        if mode != "keyword":
            v = np.asarray(_need(vector, mode), dtype=np.float32).reshape(-1)
            if v.shape != (self.dim,) or not np.all(np.isfinite(v)):
                raise IndexError_(f"the query vector must hold {self.dim} finite numbers (got {v.size})")
        if mode != "vector" and (not isinstance(text, str) or not text.strip()):
            raise IndexError_("a keyword or hybrid search needs query text")

        def run(c) -> list[tuple]:
            if mode == "vector":
                return self._vector(c, tenant, v, filters, k)
            if mode == "keyword":
                return self._keyword(c, tenant, text, filters, k)
            depth = max(k, 20)  # both searches in one transaction: one snapshot
            dense, sparse = self._vector(c, tenant, v, filters, depth), self._keyword(c, tenant, text, filters, depth)
            by_id = {r[0]: r for r in sparse + dense}
            fused = q.rrf([[r[0] for r in dense], [r[0] for r in sparse]], k)
            return [(*by_id[cid][:4], score) for cid, score in fused]

        rows = self._run(run, retry=True)
        return [Hit(cid, ten, txt, float(score), meta) for cid, ten, txt, meta, score in rows]

    def close(self) -> None:
        with self._lock:
            if not self._conn.closed:
                self._conn.close()

    def __enter__(self) -> PgStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _need(vector: np.ndarray | None, mode: str) -> np.ndarray:
    if vector is None:
        raise IndexError_(f"a {mode} search needs a query vector (an embedder, or --vector-file)")
    return vector
