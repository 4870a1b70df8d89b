"""`stalwart bench data`: prepare throughput, loader throughput, loader memory and first-batch latency.

1. ``data prepare`` of real text (the standard library's sources, repeated to ``--mb``) with 1 and 2
   workers, against Hugging Face ``tokenizers`` batch encoding of the same text in one process.
2. The training loader reading prepared shards (one rank of the reference workload: global batch 8,
   sequences of 256): tokens/s with no prefetch, and the first batch's latency from opening the dataset.
3. The loader's memory on synthetic token shards of two sizes (default 100 MB and 1 GB of tokens), each
   measured in a fresh process while the loader is open: resident memory (private and file-backed) and its
   peak, after the same batches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from stalwart.config.arguments import ArgumentParser, at_least, listed, positive


def _text_corpus(root: Path, mb: float) -> Path:
    from stalwart.data.corpus import default_corpus_root

    src = sorted(default_corpus_root().rglob("*.py"))
    out = root / "text"
    out.mkdir()
    total, i = 0, 0
    while total < mb * 1e6:
        f = src[i % len(src)]
        if "site-packages" not in f.parts and "test" not in f.parts:
            try:
                data = f.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                data = ""
            if data:
                (out / f"{i:06d}.txt").write_text(f"# copy {i // len(src)}\n{data}")
                total += len(data)
        i += 1
    return out


def bench_prepare(root: Path, mb: float) -> dict:
    from stalwart.data.corpus import Corpus
    from stalwart.data.prepare import Source, prepare
    from stalwart.data.tokenizer import eos_id, train_on

    text = _text_corpus(root, mb)
    corpus = Corpus(str(text), val_fraction=0.0)
    tok = train_on([corpus], 4096, 4.0)
    texts = [corpus.read(d) for d in corpus.train]
    nbytes = sum(len(t.encode()) for t in texts)
    t0 = time.perf_counter()
    ntok = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    ceiling = time.perf_counter() - t0
    out = {"text_mb": nbytes / 1e6, "tokens": ntok,
           "hf_encode_batch": {"s": ceiling, "mb_s": nbytes / 1e6 / ceiling, "tok_s": ntok / ceiling}}
    for workers in (1, 2):
        t0 = time.perf_counter()
        prepare([Source("text", str(text))], root / f"prep{workers}", tok, eos_id(tok), workers=workers,
                val_fraction=0.0, shard_mb=2.0, corpora=[corpus])
        dt = time.perf_counter() - t0
        out[f"prepare_workers_{workers}"] = {"s": dt, "mb_s": nbytes / 1e6 / dt, "tok_s": ntok / dt}
    out["prepared_dir"] = str(root / "prep1")
    return out


def bench_loader(path: str, batches: int) -> dict:
    from stalwart.data.loader import DataLoader
    from stalwart.data.prepared import open_prepared

    t0 = time.perf_counter()
    data = open_prepared(path)
    loader = DataLoader(data.split("train"), data.names, [1.0], 256, 8, 8, 0, 1, seed=0, prefetch=0)
    loader.next()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(batches):
        loader.next()
    dt = time.perf_counter() - t0
    return {"first_batch_s": first, "batches": batches, "tokens_per_s": batches * 8 * 256 / dt,
            "rss_with_loader_open": _rss()}


def _synthetic(root: Path, token_mb: float) -> Path:
    """Random uint16 tokens in 64 MB shards with an index, as `data prepare` writes them."""
    from stalwart.data.prepare import FORMAT, INDEX
    from stalwart.data.shards import write_shard

    out = root / f"synthetic-{int(token_mb)}mb"
    out.mkdir()
    rng = np.random.default_rng(0)
    shards, left, k = [], int(token_mb * 1e6 / 2), 0
    while left > 0:
        n = min(left, 32_000_000)
        docs = np.split(rng.integers(1, 4096, n, dtype=np.int64), np.arange(2000, n, 2000))
        entry = write_shard(out / f"syn.train.{k:05d}", docs, np.dtype(np.uint16))
        shards.append(entry)
        left, k = left - n, k + 1
    val = write_shard(out / "syn.val.00000", [rng.integers(1, 4096, 5000)], np.dtype(np.uint16))

    def part(s):
        return {"documents": sum(x["documents"] for x in s), "tokens": sum(x["tokens"] for x in s), "shards": s}

    index = {"format": FORMAT, "tokenizer_sha256": "synthetic", "vocab_size": 4096, "eos_id": 0, "dtype": "uint16",
             "sources": [{"name": "syn", "path": "", "train": part(shards), "val": part([val])}]}
    (out / INDEX).write_text(json.dumps(index))
    return out


def _rss() -> dict:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart bench data", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=positive, default=20.0, help="text for the prepare benchmark (MB)")
    p.add_argument("--rss-mb", type=listed(positive), default="100,1000",
                   help="synthetic token-file sizes for the memory test (MB)")
    p.add_argument("--batches", type=at_least(1), default=2000, help="loader batches to time")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # one memory measurement, in a fresh process
        import torch  # noqa: F401  (the trainer's process has torch loaded: count it in both)

        base = _rss()
        result = bench_loader(args.child, args.batches)
        print(json.dumps({"rss_before": base, **result}))
        return 0
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-data-") as tmp:
        root = Path(tmp)
        prep = bench_prepare(root, args.mb)
        print(json.dumps({"prepare": prep}), flush=True)
        print(json.dumps({"loader": bench_loader(prep["prepared_dir"], args.batches)}), flush=True)
        for mb in args.rss_mb:
            path = _synthetic(root, mb)
            child = subprocess.run([sys.executable, "-m", "stalwart", "bench", "data", "--child", str(path),
                                    "--batches", str(args.batches)], capture_output=True, text=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
            print(json.dumps({"memory_token_mb": mb, **json.loads(child.stdout)}), flush=True)
    return 0
