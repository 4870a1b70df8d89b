"""`stalwart bench retrieval-ingest`: kill -9 a real `stalwart index add` at random points, re-run it after
each kill, and compare the index with an uninterrupted ingest of the same file.

Chunks are synthetic (seeded random vectors and texts over several tenants). Each interrupted run is killed
with SIGKILL after a random number of commits it reported, plus a random delay of up to ``--max-delay``
seconds (so some kills land inside a batch's write). The final index must equal the uninterrupted one: the
same ids, tenants, texts, metadata and vectors, bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from stalwart.config.arguments import ArgumentParser, at_least


def synthetic_chunks(path: Path, n: int, dim: int, tenants: int, seed: int = 0) -> Path:
    """``n`` chunks with seeded random unit vectors (float32 values written exactly) as JSON Lines."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "kernel", "tensor", "index", "shard", "vector", "query"]
    with path.open("w") as fh:
        for lo in range(0, n, 10_000):
            m = min(10_000, n - lo)
            v = rng.standard_normal((m, dim)).astype(np.float32)
            v /= np.linalg.norm(v, axis=1, keepdims=True)
            pick = rng.integers(0, len(words), (m, 6))
            for i in range(m):
                j = lo + i
                fh.write(json.dumps({"id": f"doc-{j:07d}", "tenant": f"t{j % tenants}",
                                     "text": " ".join(words[w] for w in pick[i]) + f" {j}",
                                     "meta": {"part": j % 7}, "vector": v[i].tolist()}) + "\n")
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "stalwart", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def create_empty(index: Path, dim: int, ann_min_rows: int | None = None) -> None:
    """An empty index (what `stalwart index build DIR --chunks EMPTY --dim N [--ann-min-rows R]` makes)."""
    from stalwart.retrieval.lance import LanceStore

    store = LanceStore(index, dim=dim, create=True)
    if ann_min_rows:
        store.set_ann_min_rows(ann_min_rows)
    store.close()


def add(index: Path, chunks: Path, batch: int) -> subprocess.CompletedProcess:
    return subprocess.run(_cli("index", "add", str(index), "--chunks", str(chunks), "--batch", str(batch), "--quiet"),
                          env=_env(), capture_output=True, text=True, check=True)


def killed_add(index: Path, chunks: Path, batch: int, commits: int, delay: float) -> dict:
    """Run `index add`; SIGKILL it ``delay`` s after it reported ``commits`` more commits (or when it ends)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(_cli("index", "add", str(index), "--chunks", str(chunks), "--batch", str(batch)),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("committed batch"):
            seen += 1
            if seen >= commits:
                break
    time.sleep(delay)
    finished = proc.poll() is not None
    if not finished:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return {"commits_seen": seen, "delay_s": round(delay, 3), "finished_before_kill": finished,
            "returncode": proc.returncode, "s": round(time.perf_counter() - t0, 2)}


def compare(a: Path, b: Path) -> dict:
    """Whether two indexes hold the same rows (ids, tenants, texts, metadata, vectors bit for bit)."""
    from stalwart.retrieval.lance import LanceStore

    ta, tb = LanceStore(a).export_rows(), LanceStore(b).export_rows()
    out = {"rows": [ta.num_rows, tb.num_rows]}
    for col in ("id", "tenant", "text", "meta", "digest"):
        out[col] = ta[col].equals(tb[col])
    va = np.asarray(ta["vector"].combine_chunks().flatten()).view(np.uint32)
    vb = np.asarray(tb["vector"].combine_chunks().flatten()).view(np.uint32)
    out["vector_bits"] = va.shape == vb.shape and bool(np.array_equal(va, vb))
    out["equal"] = all(out[c] for c in ("id", "tenant", "text", "meta", "digest", "vector_bits"))
    return out


def kill_and_resume(root: Path, chunks: Path, n: int, dim: int, batch: int, kills: int, seed: int,
                    max_delay: float = 0.3, log=print, ann_min_rows: int | None = None) -> dict:
    """The experiment: an uninterrupted ingest, and one killed ``kills`` times then finished; compared."""
    rng = random.Random(seed)
    clean, killed = root / "clean", root / "killed"
    for ix in (clean, killed):
        create_empty(ix, dim, ann_min_rows)
    t0 = time.perf_counter()
    add(clean, chunks, batch)
    clean_s = time.perf_counter() - t0
    nbatches = (n + batch - 1) // batch
    runs = []
    for i in range(kills):
        # a random point spread over the whole ingest: each run resumes, so aim at the batches still to do
        run = killed_add(killed, chunks, batch, rng.randint(1, max(1, nbatches // (kills + 1))),
                         rng.uniform(0.0, max_delay))
        runs.append(run)
        log(f"kill {i + 1}/{kills}: {run}")
    t0 = time.perf_counter()
    final = add(killed, chunks, batch)
    cmp = compare(clean, killed)
    log(f"final run: {final.stdout.strip()}")
    return {"chunks": n, "dim": dim, "batch": batch, "kills": runs, "clean_ingest_s": round(clean_s, 1),
            "final_run_s": round(time.perf_counter() - t0, 1), "compare": cmp}


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart bench retrieval-ingest", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=at_least(1), default=100_000)
    p.add_argument("--dim", type=at_least(1), default=64)
    p.add_argument("--batch", type=at_least(1), default=1024)
    p.add_argument("--kills", type=at_least(1), default=10)
    p.add_argument("--tenants", type=at_least(1), default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-delay", type=float, default=0.3, help="longest wait after the last commit seen (s)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-ingest-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        chunks = synthetic_chunks(root / "chunks.jsonl", args.chunks, args.dim, args.tenants, args.seed)
        print(f"synthetic chunks (random vectors, not an embedder's): {args.chunks} x dim {args.dim}, "
              f"{chunks.stat().st_size / 1e6:.0f} MB, {time.perf_counter() - t0:.1f} s", flush=True)
        res = kill_and_resume(root, chunks, args.chunks, args.dim, args.batch, args.kills, args.seed, args.max_delay,
                              log=lambda s: print(s, flush=True))
    res["load_avg"] = os.getloadavg()
    print(json.dumps(res))
    print("RESULT: " + ("identical to the uninterrupted ingest" if res["compare"]["equal"]
                        else f"DIFFERENT: {res['compare']}"))
    return 0 if res["compare"]["equal"] else 1
