"""`stalwart index build|add|delete|query|stats`: a retrieval index of chunks (an embedded LanceDB directory,
or a PostgreSQL URL), crash-safe ingest, and search scoped to one tenant.

Every command checks its input before it writes: a bad flag, line, vector length, tenant name or filter is one
line on stderr, exit 2, and the index is as it was. `index build` refuses a directory that is not empty; an
interrupted build or add is finished by running `index add` with the same file (committed batches are skipped).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stalwart.config.arguments import ArgumentParser, at_least

USAGE = "usage: stalwart index {build,add,delete,query,stats} ...   (stalwart index build --help)"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("index", metavar="DIR", help="the index: a directory (LanceDB), or a postgresql:// URL")


def _ingest_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunks", required=True, metavar="FILE.jsonl",
                   help='one chunk per line: {"id", "tenant", "text", "meta": {...}, "vector": [...] (optional)}')
    p.add_argument("--batch", type=at_least(1), default=1024,
                   help="chunks per commit (default 1024); a re-run must use the same value to resume")
    p.add_argument("--quiet", action="store_true", help="no line per committed batch")


def _build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="stalwart index build", description=(
        "Create an index from chunks: ingest them in batches (one commit each), then build the indexes (tenant, "
        "id, metadata tags, BM25 on text; a vector index at --ann-min-rows rows and above). DIR must be "
        "new or empty; add to an existing index, or finish an interrupted build, with `stalwart index add`."))
    _common(p)
    _ingest_flags(p)
    p.add_argument("--embedder", default="", metavar="MODEL_DIR",
                   help="an embeddings model directory: it embeds chunks without a 'vector', and query text")
    p.add_argument("--dim", type=at_least(1), default=None,
                   help="vector length (default: the embedder's, else the first chunk's vector)")
    p.add_argument("--ann-min-rows", type=at_least(1), default=None,
                   help="build the vector index once the index holds this many rows (default 10000; below it "
                        "search is exact); later `index add` runs keep the setting")
    p.add_argument("--ann", choices=["auto", "IVF_RQ", "IVF_FLAT", "IVF_HNSW_SQ", "IVF_PQ"], default="auto",
                   help="vector index kind (auto: IVF_RQ from 128 dimensions, else IVF_FLAT; docs/retrieval.md "
                        "compares them)")
    return p


def _add_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="stalwart index add", description=(
        "Add chunks to an existing index (the embedder recorded in it embeds chunks without a vector). Batch k is "
        "chunks [k*B, (k+1)*B) of the file, one commit each; a re-run of an interrupted add skips the committed "
        "batches and adds the rest once. An id already in the index with other content is refused."))
    _common(p)
    _ingest_flags(p)
    return p


def _delete_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="stalwart index delete", description="Delete chunks of one tenant by id "
                       "(ids of other tenants are never touched); prints how many were deleted.")
    _common(p)
    p.add_argument("--tenant", required=True)
    ids = p.add_mutually_exclusive_group(required=True)
    ids.add_argument("--ids", help="comma-separated ids")
    ids.add_argument("--ids-file", help="a file of ids, one per line")
    return p


def _query_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="stalwart index query", description=(
        "Search one tenant's chunks: vector (cosine), keyword (BM25) or hybrid (both, fused by reciprocal rank). "
        "The tenant and filters are applied inside both searches."))
    _common(p)
    p.add_argument("--tenant", required=True)
    p.add_argument("--text", default=None, help="query text (embedded by the index's embedder for vector search)")
    p.add_argument("--vector-file", default=None, help="a JSON file holding the query vector: [0.1, ...]")
    p.add_argument("--mode", choices=["vector", "keyword", "hybrid"], default=None,
                   help="default: hybrid when there is text and a vector, else whichever there is")
    p.add_argument("--k", type=at_least(1), default=10, help="hits (default 10, at most 1000)")
    p.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE",
                   help="metadata equal to VALUE (JSON, else text; a JSON list means any of them); repeatable")
    p.add_argument("--json", action="store_true", help="hits as a JSON list")
    return p


def _stats_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="stalwart index stats", description="What an index holds (an operator's view: "
                       "every tenant's row count).")
    _common(p)
    p.add_argument("--json", action="store_true")
    return p


def _embedder(model_dir: str):
    """The embeddings model (imported only when an index uses one)."""
    from stalwart.retrieval.records import IndexError_

    try:
        from stalwart.retrieval.embed import Embedder
    except ImportError:
        raise IndexError_("--embedder: this stalwart has no embedder (stalwart.retrieval.embed); "
                          "give vectors") from None
    if not Path(model_dir).is_dir():
        raise IndexError_(f"--embedder: {model_dir} is not a model directory")
    return Embedder(model_dir)


def _open_embedder(store):
    """The embedder an existing index was built with, or None (vectors supplied)."""
    from stalwart.retrieval.records import IndexError_

    if not store.embedder:
        return None
    model_dir = getattr(store, "manifest", {}).get("embedder_dir", "")
    emb = _embedder(model_dir)
    if emb.name != store.embedder:
        raise IndexError_(f"the index was built with embedder {store.embedder!r}; {model_dir} is now {emb.name!r}")
    return emb


def _peek(address: str) -> tuple[int | None, str]:
    """(vector length, embedder name) of an existing index from its manifest, without opening the store, so
    that bad input is refused before the store's import; (None, '') for a server's index (read when opened)."""
    from stalwart.retrieval.lance import read_manifest
    from stalwart.retrieval.open import is_postgres

    if is_postgres(address):
        return None, ""
    man = read_manifest(Path(address))
    return man["dim"], man["embedder"]


def _progress(quiet: bool):
    def on_commit(k: int, n: int) -> None:
        if not quiet:
            print(f"committed batch {k} ({n} chunks)", flush=True)
    return on_commit


def build_main(argv: list[str]) -> int:
    from stalwart.retrieval.ingest import ingest, read_chunks
    from stalwart.retrieval.lance import AnnParams, LanceStore
    from stalwart.retrieval.open import is_postgres, open_store
    from stalwart.retrieval.records import IndexError_

    args = _build_parser().parse_args(argv)
    if not is_postgres(args.index):
        d = Path(args.index)
        if d.exists() and (not d.is_dir() or any(d.iterdir())):
            raise IndexError_(f"{d} exists and is not an empty directory; give a new directory, or add to (or finish "
                              f"building) that index with `stalwart index add {d} --chunks ...`")
    emb = _embedder(args.embedder) if args.embedder else None
    dim = emb.dim if emb is not None else args.dim
    if emb is not None and args.dim is not None and args.dim != emb.dim:
        raise IndexError_(f"--dim {args.dim}: the embedder's vectors have {emb.dim} numbers")
    chunks, lines = read_chunks(args.chunks, dim)  # every line checked before the index exists
    if dim is None:
        dim = next((len(c.vector) for c in chunks if c.vector is not None), None)
        if dim is None:
            raise IndexError_("no chunk has a 'vector' and no --embedder was given: give --embedder, or vectors")
    store = open_store(args.index, dim=dim, create=True, embedder=emb.name if emb else "",
                       embedder_dir=str(Path(args.embedder).resolve()) if emb else "")
    try:
        rep = ingest(store, chunks, lines, batch=args.batch, embed_fn=emb.embed if emb else None,
                     where=args.chunks, on_commit=_progress(args.quiet))
    except IndexError_:
        if isinstance(store, LanceStore) and store.total_rows() == 0:
            import shutil

            store.close()
            shutil.rmtree(args.index, ignore_errors=True)  # refused before any commit: as if never built
        raise
    ann = None
    if isinstance(store, LanceStore):
        if args.ann_min_rows:
            store.set_ann_min_rows(args.ann_min_rows)
        ann = store.build_indexes(AnnParams(kind=args.ann))
    vec = f"{ann['kind']}, {ann['partitions']} partitions" if ann else "none (exact search)"
    print(f"index {args.index}: {rep.records} chunks in {rep.batches} batches (dim {dim}); vector index: {vec}")
    return 0


def add_main(argv: list[str]) -> int:
    from stalwart.retrieval.ingest import ingest, read_chunks
    from stalwart.retrieval.lance import LanceStore
    from stalwart.retrieval.open import open_store

    args = _add_parser().parse_args(argv)
    dim, _ = _peek(args.index)
    if dim is not None:
        chunks, lines = read_chunks(args.chunks, dim)  # every line checked before the store is opened
    store = open_store(args.index)
    if dim is None:
        chunks, lines = read_chunks(args.chunks, store.dim)
    emb = _open_embedder(store)
    rep = ingest(store, chunks, lines, batch=args.batch, embed_fn=emb.embed if emb else None,
                 where=args.chunks, on_commit=_progress(args.quiet))
    if isinstance(store, LanceStore) and rep.added:
        store.build_indexes(rebuild=False)
    print(f"index {args.index}: {rep.added} batches added, {rep.skipped} already committed "
          f"({rep.records} chunks in {rep.batches} batches)")
    return 0


def delete_main(argv: list[str]) -> int:
    from stalwart.retrieval.open import open_store
    from stalwart.retrieval.records import IndexError_, check_tenant

    args = _delete_parser().parse_args(argv)
    check_tenant(args.tenant, "--tenant")
    if args.ids is not None:
        ids = [i for i in args.ids.split(",") if i]
    else:
        try:
            lines = Path(args.ids_file).read_text(encoding="utf-8").splitlines()
            ids = [line.strip() for line in lines if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise IndexError_(f"--ids-file: cannot read {args.ids_file} ({e})") from None
    if not ids:
        raise IndexError_("no ids given")
    from stalwart.retrieval.query import ids_clause

    ids_clause(args.tenant, ids)  # every id checked before the first delete
    _peek(args.index)
    store = open_store(args.index)
    print(f"deleted {store.delete(args.tenant, ids)} of {len(ids)} ids for tenant {args.tenant}")
    return 0


def _vector_file(path: str, dim: int):
    import numpy as np

    from stalwart.retrieval.records import IndexError_

    try:
        vec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise IndexError_(f"--vector-file: cannot read a JSON list from {path} ({e})") from None
    if not isinstance(vec, list) or len(vec) != dim or not all(isinstance(x, (int, float)) for x in vec):
        raise IndexError_(f"--vector-file: expected a JSON list of {dim} numbers")
    return np.asarray(vec, dtype=np.float32)


def query_main(argv: list[str]) -> int:
    from stalwart.retrieval.open import open_store
    from stalwart.retrieval.query import parse_filter_args, where_clause
    from stalwart.retrieval.records import IndexError_, check_tenant

    args = _query_parser().parse_args(argv)
    check_tenant(args.tenant, "--tenant")
    filters = parse_filter_args(args.filter)
    where_clause(args.tenant, filters)
    if args.text is None and args.vector_file is None:
        raise IndexError_("give --text or --vector-file")
    if args.k > 1000:
        raise IndexError_(f"--k must be at most 1000 (got {args.k})")
    dim, embedder = _peek(args.index)
    if dim is None:  # a server's index: its manifest is in the database
        store = open_store(args.index)
        dim, embedder = store.dim, store.embedder
    vector = _vector_file(args.vector_file, dim) if args.vector_file else None
    mode = args.mode or ("hybrid" if args.text and (vector is not None or embedder)
                         else "keyword" if args.text else "vector")
    if mode != "vector" and not args.text:
        raise IndexError_(f"a {mode} search needs --text")
    if vector is None and mode != "keyword" and not embedder:
        raise IndexError_(f"a {mode} search needs --vector-file: this index has no embedder")
    store = open_store(args.index)
    if vector is None and mode != "keyword":
        vector = _open_embedder(store).embed([args.text])[0]
    hits = store.search(args.tenant, vector=vector, text=args.text, mode=mode, k=args.k, filters=filters)
    if args.json:
        print(json.dumps([{"id": h.id, "tenant": h.tenant, "score": h.score, "text": h.text, "meta": h.meta}
                          for h in hits]))
    else:
        for i, h in enumerate(hits, start=1):
            print(f"{i:>3} {h.score:8.4f}  {h.id}  {h.text[:80]!r}")
        if not hits:
            print(f"no hits ({mode})")
    return 0


def stats_main(argv: list[str]) -> int:
    from stalwart.retrieval.lance import LanceStore
    from stalwart.retrieval.open import open_store

    args = _stats_parser().parse_args(argv)
    store = open_store(args.index)
    out = {"dim": store.dim, "embedder": store.embedder or None}
    if isinstance(store, LanceStore):
        out |= {"rows": store.total_rows(), "tenants": store.tenants(), "version": store.version(),
                "vector_index": store.manifest.get("ann"), "created_version": store.manifest.get("created_version")}
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        for k, v in out.items():
            print(f"{k:<16} {v}")
    return 0


COMMANDS = {"build": build_main, "add": add_main, "delete": delete_main, "query": query_main, "stats": stats_main}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] not in COMMANDS:
        print(f"stalwart index: unknown subcommand '{argv[0]}'. {USAGE}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
