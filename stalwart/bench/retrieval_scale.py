"""`stalwart bench retrieval-scale`: query latency of the embedded index at scale, scoped to one tenant.

The data is synthetic and says so: random unit vectors of intrinsic dimension 32 (not an embedder's),
texts of words drawn from a Zipf-distributed vocabulary, spread evenly over ``--tenants``
tenants. The bench builds the index (batched adds, then the scalar and BM25 indexes), measures vector
search exactly (a flat scan of the tenant's rows), builds the IVF vector index, and measures again:

- p50/p95/p99 latency of vector and hybrid (vector + BM25, fused by reciprocal rank) search for one tenant,
  and of the keyword search alone, with query words that are the commonest (the worst case) or middling;
- recall@10 of the vector index against exact search (numpy over the tenant's vectors);
- median latency for a tenant with rows, a small tenant, an emptied tenant (rows deleted) and a tenant that
  never existed: a query's time should say nothing about tenants other than its own.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from stalwart.config.arguments import ArgumentParser, at_least


def _words(rng: np.random.Generator, n: int) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return ["".join(rng.choice(letters, size=int(rng.integers(3, 9)))) for _ in range(n)]


class Synthetic:
    """Unit vectors of low intrinsic dimension (a random linear map of a ``latent``-dimensional Gaussian,
    plus a little noise, as embeddings are: nearest neighbours are well defined, not near-ties as between
    independent random vectors) and Zipf texts, generated batch by batch from one seed."""

    def __init__(self, dim: int, tenants: int, seed: int, latent: int = 32, noise: float = 0.05) -> None:
        self.rng = np.random.default_rng(seed)
        self.dim, self.tenants, self.noise = dim, tenants, noise
        self.map = (self.rng.standard_normal((latent, dim)) / np.sqrt(latent)).astype(np.float32)
        self.vocab = _words(self.rng, 5000)

    def vectors(self, n: int) -> np.ndarray:
        z = self.rng.standard_normal((n, self.map.shape[0])).astype(np.float32)
        v = z @ self.map + self.rng.standard_normal((n, self.dim)).astype(np.float32) * (self.noise / np.sqrt(self.dim))
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    def texts(self, n: int, words: int = 24) -> list[str]:
        idx = np.minimum(self.rng.zipf(1.3, (n, words)) - 1, len(self.vocab) - 1)
        return [" ".join(self.vocab[i] for i in row) for row in idx]


def build(store, data: Synthetic, n: int, batch: int, log) -> dict[str, np.ndarray]:
    """Add ``n`` chunks (tenant = index mod tenants); returns tenant -> its vectors (for exact recall)."""
    from stalwart.retrieval.records import Chunk

    per: dict[str, list[np.ndarray]] = {}
    t0 = time.perf_counter()
    for lo in range(0, n, batch):
        m = min(batch, n - lo)
        vecs, texts = data.vectors(m), data.texts(m)
        tenants = [f"t{(lo + i) % data.tenants}" for i in range(m)]
        store.add([Chunk(f"doc-{lo + i:08d}", tenants[i], texts[i], {"part": (lo + i) % 7}) for i in range(m)], vecs)
        for t in set(tenants):
            per.setdefault(t, []).append(vecs[[i for i in range(m) if tenants[i] == t]])
        if (lo // batch) % 10 == 0:
            log(f"  added {lo + m}/{n} ({time.perf_counter() - t0:.0f} s)")
    return {t: np.concatenate(v) for t, v in per.items()}


def _pct(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e3
    return {"p50_ms": round(float(np.percentile(a, 50)), 2), "p95_ms": round(float(np.percentile(a, 95)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "n": len(xs)}


def latency(store, tenant: str, queries: np.ndarray, texts: list[str], mode: str, k: int) -> tuple[dict, list]:
    times, results = [], []
    for q, t in zip(queries, texts):
        t0 = time.perf_counter()
        hits = store.search(tenant, vector=q, text=t, mode=mode, k=k)
        times.append(time.perf_counter() - t0)
        results.append([h.id for h in hits])
        assert all(h.tenant == tenant for h in hits)
    return _pct(times), results


def recall(store, tenant: str, queries: np.ndarray, tenant_vecs: np.ndarray, tenant_ids: np.ndarray, k: int) -> float:
    got = [{h.id for h in store.search(tenant, vector=q, mode="vector", k=k)} for q in queries]
    exact = [set(tenant_ids[np.argsort(-(tenant_vecs @ q))[:k]]) for q in queries]
    return round(float(np.mean([len(g & e) / k for g, e in zip(got, exact)])), 4)


def tenant_timing(store, queries: np.ndarray, k: int) -> dict:
    """Median vector-search latency per kind of tenant, the tenants interleaved query by query."""
    kinds = {"with_rows": "t0", "small": "small", "emptied": "emptied", "never_existed": "ghost"}
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for q in queries:
        for name, tenant in kinds.items():
            t0 = time.perf_counter()
            store.search(tenant, vector=q, mode="vector", k=k)
            times[name].append(time.perf_counter() - t0)
    return {name: round(float(np.median(v)) * 1e3, 2) for name, v in times.items()}


def main(argv: list[str]) -> int:
    from stalwart.retrieval.lance import AnnParams, LanceStore
    from stalwart.retrieval.records import Chunk

    p = ArgumentParser(prog="stalwart bench retrieval-scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=at_least(1), default=100_000)
    p.add_argument("--dim", type=at_least(8), default=256)
    p.add_argument("--tenants", type=at_least(1), default=10)
    p.add_argument("--queries", type=at_least(10), default=500)
    p.add_argument("--k", type=at_least(1), default=10)
    p.add_argument("--batch", type=at_least(1), default=20_000, help="chunks per commit while building")
    p.add_argument("--ann", choices=["auto", "IVF_RQ", "IVF_FLAT", "IVF_HNSW_SQ", "IVF_PQ"], default="auto")
    p.add_argument("--partitions", type=int, default=0, help="IVF partitions (0: the kind's default)")
    p.add_argument("--sub-vectors", type=int, default=0, help="PQ sub-vectors (0: dim / 2)")
    p.add_argument("--nprobes", type=int, default=0, help="partitions probed (0: the kind's default)")
    p.add_argument("--refine", type=int, default=0, help="exact re-rank of refine * k candidates (0: the default)")
    p.add_argument("--no-exact", action="store_true", help="skip the exact (flat) search measurement")
    p.add_argument("--dir", default="", help="build here (kept) instead of a temporary directory")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    def log(s: str) -> None:
        print(s, flush=True)

    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="stalwart-bench-retrieval-")
    root = Path(args.dir or tmp.name)
    res: dict = {"chunks": args.chunks, "dim": args.dim, "tenants": args.tenants,
                 "data": "synthetic (random unit vectors of intrinsic dimension 32, Zipf word texts; no embedder)",
                 "load_start": os.getloadavg()}
    log(f"retrieval-scale: {args.chunks} synthetic chunks (random vectors of intrinsic dimension 32, not an "
        f"embedder's), dim "
        f"{args.dim}, {args.tenants} tenants, {args.queries} queries; load {os.getloadavg()[0]:.1f}")
    try:
        data = Synthetic(args.dim, args.tenants, args.seed)
        store = LanceStore(root / "ix", dim=args.dim, create=True)
        t0 = time.perf_counter()
        per = build(store, data, args.chunks, args.batch, log)
        store.add([Chunk(f"small-{i}", "small", data.texts(1)[0]) for i in range(10)], data.vectors(10))
        store.add([Chunk(f"gone-{i}", "emptied", data.texts(1)[0]) for i in range(10)], data.vectors(10))
        store.delete("emptied", [f"gone-{i}" for i in range(10)])
        res["add_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        store.build_indexes(min_rows=1 << 62)  # scalar + BM25 indexes over every row, no vector index yet
        res["scalar_fts_index_s"] = round(time.perf_counter() - t0, 1)
        log(f"added in {res['add_s']} s, scalar+BM25 indexes in {res['scalar_fts_index_s']} s")

        tenant = "t0"
        tv = per[tenant]
        tids = np.array([f"doc-{i:08d}" for i in range(0, args.chunks, args.tenants)])
        # queries: near stored vectors of the tenant (a real query resembles some documents), new noise
        pick = data.rng.integers(0, len(tv), args.queries)
        noise = data.rng.standard_normal((args.queries, args.dim)).astype(np.float32) * (0.3 / np.sqrt(args.dim))
        queries = tv[pick] + noise
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        # query texts: 3 words of a Zipf text (mostly the commonest words: long posting lists, the worst case
        # for BM25, as stop words would be), and 3 words of middling frequency (ranks 100-4999)
        qtexts = [" ".join(t.split()[:3]) for t in data.texts(args.queries)]
        mid = [" ".join(data.vocab[i] for i in data.rng.integers(100, len(data.vocab), 3)) for _ in qtexts]
        nrec = min(100, args.queries)
        for q in queries[:20]:  # warm the caches
            store.search(tenant, vector=q, text="warm", mode="hybrid")
        if not args.no_exact:  # at most 100 queries: a flat scan of a large tenant takes a while
            res["exact_vector"], _ = latency(store, tenant, queries[:100], qtexts, "vector", args.k)
            res["exact_hybrid"], _ = latency(store, tenant, queries[:100], qtexts, "hybrid", args.k)
            res["exact_recall@10"] = recall(store, tenant, queries[:nrec], tv, tids, args.k)
            log(f"exact: vector {res['exact_vector']}  hybrid {res['exact_hybrid']}  "
                f"recall@10 {res['exact_recall@10']}")
        ann = AnnParams(kind=args.ann, partitions=args.partitions, sub_vectors=args.sub_vectors,
                        nprobes=args.nprobes, refine_factor=args.refine)
        t0 = time.perf_counter()
        res["ann"] = store.build_indexes(ann, min_rows=1)
        res["ann_build_s"] = round(time.perf_counter() - t0, 1)
        log(f"vector index {res['ann']} built in {res['ann_build_s']} s")
        store = LanceStore(root / "ix")  # reopened: queries read the manifest's probe settings
        for q in queries[:20]:
            store.search(tenant, vector=q, text="warm", mode="hybrid")
        res["ann_vector"], _ = latency(store, tenant, queries, qtexts, "vector", args.k)
        res["ann_hybrid"], _ = latency(store, tenant, queries, qtexts, "hybrid", args.k)
        res["keyword_common_words"], _ = latency(store, tenant, queries, qtexts, "keyword", args.k)
        res["keyword_mid_words"], _ = latency(store, tenant, queries, mid, "keyword", args.k)
        res["ann_hybrid_mid_words"], _ = latency(store, tenant, queries, mid, "hybrid", args.k)
        res["ann_recall@10"] = recall(store, tenant, queries[:nrec], tv, tids, args.k)
        log(f"ann: vector {res['ann_vector']}  hybrid {res['ann_hybrid']}  recall@10 {res['ann_recall@10']}")
        log(f"keyword (common words) {res['keyword_common_words']}  keyword (middling words) "
            f"{res['keyword_mid_words']}  hybrid (middling words) {res['ann_hybrid_mid_words']}")
        res["tenant_median_ms"] = tenant_timing(store, queries[:200], args.k)
        log(f"median ms by tenant kind: {res['tenant_median_ms']}")
        du = sum(f.stat().st_size for f in (root / "ix").rglob("*") if f.is_file())
        res["index_mb"] = round(du / 2**20, 1)
    finally:
        if tmp is not None:
            tmp.cleanup()
    res["load_end"] = os.getloadavg()
    print(json.dumps(res))
    return 0
