"""`stalwart bench retrieval`: retrieval quality and embedding speed of embeddings models trained here.

Quality: the held-out pairs of a pairs dataset (``stalwart data pairs``: docstring -> function, whole
packages the model never saw) become an index of the functions' code (one tenant), built with the
real ingest into the embedded store; each docstring is a query in three modes (BM25 alone, the
embedder alone, both fused), all through ``Store.search``. Reported: recall@1, recall@10 and MRR@10 for
each model given (a curve over model sizes and training steps when several are given, e.g. a run's
checkpoints).

Speed: the embedder over every held-out chunk, batch by batch as ingest runs it: chunks/s, tokens/s and
model FLOP/s against this machine's measured matmul peak for the embedder's dtype and threads.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from stalwart.config.arguments import ArgumentParser

MODES = ("keyword", "vector", "hybrid")


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="stalwart bench retrieval", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", required=True, help="a pairs dataset directory (stalwart data pairs --out)")
    p.add_argument("--embedder", action="append", required=True, metavar="RUN_OR_CHECKPOINT",
                   help="an embeddings model (run dir, checkpoint or exported dir); repeat for a curve")
    p.add_argument("--k", type=int, default=10, help="recall@k (default 10)")
    p.add_argument("--limit", type=int, default=0, help="use only the first N held-out pairs (0 = all)")
    p.add_argument("--batch", type=int, default=64, help="texts per embedder forward (default 64)")
    p.add_argument("--out", default="", help="also write the figures as JSON here")
    return p


def ranks(hits: list[list[str]], truth: list[str]) -> list[int]:
    """1-based position of each query's own chunk in its hits (0 = not among them)."""
    return [h.index(t) + 1 if t in h else 0 for h, t in zip(hits, truth)]


def scores(pos: list[int], k: int) -> dict[str, float]:
    p = np.asarray(pos)
    return {"recall@1": float(np.mean(p == 1)), f"recall@{k}": float(np.mean((p >= 1) & (p <= k))),
            f"mrr@{k}": float(np.mean(np.where((p >= 1) & (p <= k), 1.0 / np.maximum(p, 1), 0.0)))}


def _speed(embedder, texts: list[str]) -> dict:
    import torch

    from stalwart.metrics.mfu import matmul_peak
    from stalwart.runtime.device import HOST

    rows = embedder.encode(texts)
    embedder.embed_tokens(rows[:embedder.batch_size])  # warm-up
    t0 = time.perf_counter()
    embedder.embed_tokens(rows)
    dt = time.perf_counter() - t0
    tokens = sum(len(r) for r in rows)
    flops = embedder.flops(tokens) / dt
    dtype = next(embedder.model.parameters()).dtype
    peak = matmul_peak(HOST, dtype)
    return {"chunks_per_s": len(rows) / dt, "tokens_per_s": tokens / dt, "model_gflops": flops / 1e9,
            "peak_gflops": peak.tflops * 1e3, "of_peak": flops / (peak.tflops * 1e12), "peak_source": peak.describe(),
            "threads": torch.get_num_threads(), "dtype": str(dtype).replace("torch.", "")}


def evaluate(embedder, pairs: list, k: int, keyword_cache: dict) -> dict:
    from stalwart.retrieval.ingest import ingest
    from stalwart.retrieval.lance import LanceStore
    from stalwart.retrieval.records import Chunk

    chunks = [Chunk(p.id, "eval", p.document) for p in pairs]
    truth = [p.id for p in pairs]
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-retrieval-") as tmp:
        store = LanceStore(Path(tmp) / "index", dim=embedder.dim, embedder=embedder.name, create=True)
        t0 = time.perf_counter()
        ingest(store, chunks, list(range(1, len(chunks) + 1)), batch=256, embed_fn=embedder.embed)
        store.build_indexes()
        build_s = time.perf_counter() - t0
        queries = embedder.embed([p.query for p in pairs])
        out = {"build_s": build_s}
        for mode in MODES:
            if mode == "keyword" and "keyword" in keyword_cache:
                out[mode] = keyword_cache["keyword"]
                continue
            t0 = time.perf_counter()
            hits = [[h.id for h in store.search("eval", vector=v, text=p.query, mode=mode, k=k)]
                    for v, p in zip(queries, pairs)]
            out[mode] = scores(ranks(hits, truth), k) | {"query_ms": 1e3 * (time.perf_counter() - t0) / len(pairs)}
        keyword_cache["keyword"] = out["keyword"]
        store.close()
    return out


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from stalwart.data.pairs import read_jsonl
    from stalwart.data.corpus import DataError
    from stalwart.models.llama import count_params
    from stalwart.retrieval.embed import Embedder

    held = Path(args.pairs) / "heldout.jsonl"
    if not held.is_file():
        raise DataError(f"--pairs {args.pairs}: no heldout.jsonl (make it with `stalwart data pairs --out DIR`)")
    pairs = read_jsonl(held)[:args.limit or None]
    print(f"retrieval quality: {len(pairs)} held-out docstring -> function queries over an index of their "
          f"{len(pairs)} functions (one tenant); recall@{args.k}; load {os.getloadavg()[0]:.1f}", flush=True)
    keyword: dict = {}
    results = []
    for where in args.embedder:
        e = Embedder(where, batch_size=args.batch)
        step = _step_of(where)
        r = evaluate(e, pairs, args.k, keyword) | {"speed": _speed(e, [p.document for p in pairs])}
        r |= {"embedder": str(where), "name": e.name, "params": count_params(e.args), "dim": e.args.dim,
              "layers": e.args.n_layers, "embed_dim": e.dim, "step": step}
        results.append(r)
        kw, vec, hyb = r["keyword"], r["vector"], r["hybrid"]
        rk = f"recall@{args.k}"
        s = r["speed"]
        print(f"{where}: {r['params'] / 1e6:.2f}M params (dim {e.args.dim}, {e.args.n_layers} layers), step {step}: "
              f"{rk} BM25 {kw[rk]:.3f}  embedder {vec[rk]:.3f} ({vec[rk] / max(kw[rk], 1e-9):.2f}x BM25)  hybrid "
              f"{hyb[rk]:.3f} | recall@1 {kw['recall@1']:.3f} / {vec['recall@1']:.3f} / {hyb['recall@1']:.3f} | "
              f"MRR {kw[f'mrr@{args.k}']:.3f} / {vec[f'mrr@{args.k}']:.3f} / {hyb[f'mrr@{args.k}']:.3f}", flush=True)
        print(f"  embedding: {s['chunks_per_s']:.0f} chunks/s, {s['tokens_per_s']:.0f} tokens/s, "
              f"{s['model_gflops']:.1f} model GFLOP/s = {100 * s['of_peak']:.0f}% of the {s['peak_gflops']:.1f} "
              f"GFLOP/s {s['dtype']} matmul peak ({s['threads']} threads; {s['peak_source']})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def _step_of(where: str) -> int | None:
    name = Path(where).name
    return int(name.split("-")[1]) if name.startswith("step-") and name.split("-")[1].isdigit() else None
