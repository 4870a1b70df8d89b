"""`stalwart bench <name>`: benchmarks are scripts that print figures, never timed tests."""

from __future__ import annotations

import importlib
import sys

from stalwart.cli.extras import require

BENCHMARKS: dict[str, tuple[str, str]] = {
    "throughput": ("stalwart.bench.throughput", "reference training workload: tokens/s, GFLOP/s, peak memory"),
    "collectives": ("stalwart.bench.collectives", "collective algorithms: bus bandwidth per size, cost-model fit"),
    "islands": ("stalwart.bench.islands", "training across sites on a shaped, delayed emulated network: sync vs "
                "DiLoCo vs streaming"),
    "inference": ("stalwart.bench.inference", "inference engine vs transformers generate: tokens/s, TTFT, TPOT"),
    "serving": ("stalwart.bench.serving", "a fleet of `stalwart serve` replicas under a trace: routing policies, "
                "prefill/decode layouts, latency classes"),
    "speculative": ("stalwart.bench.speculative", "prompt-lookup speculative decoding on code: acceptance, speed-up"),
    "layouts": ("stalwart.bench.layouts", "parallel layouts: tokens/s vs one process, per-rank state bytes"),
    "checkpoint": ("stalwart.bench.checkpoint", "checkpoint save/restore vs raw disk bandwidth, async/snapshot stall"),
    "moe": ("stalwart.bench.moe", "mixture of experts: grouped matmul vs expert loop, bias balancing"),
    "data": ("stalwart.bench.data", "data prepare MB/s and tokens/s vs tokenizers, loader tokens/s, RSS, first batch"),
    "sandbox": ("stalwart.bench.sandbox", "reward sandbox: programs scored per second, serial and threaded"),
    "observe": ("stalwart.bench.observe_overhead", "observability hot path (phase timer, flight recorder) as % of a step"),
    "weight-sync": ("stalwart.bench.weight_sync", "RL weight sync trainers -> generators: direct vs via the controller"),
    "retrieval": ("stalwart.bench.retrieval", "retrieval quality of embeddings models trained here (recall@10: BM25, "
                  "embedder, hybrid) and their embedding speed vs the matmul peak"),
    "retrieval-scale": ("stalwart.bench.retrieval_scale", "retrieval index at scale: vector and hybrid query "
                        "latency p50/p95/p99 scoped to a tenant, ANN recall@10, tenant timing"),
    "retrieval-ingest": ("stalwart.bench.retrieval_ingest", "kill -9 `stalwart index add` at random points, re-run, "
                         "compare with an uninterrupted ingest bit for bit"),
}
# benchmark -> the module an optional extra provides that it needs (checked before it is imported)
NEEDS: dict[str, str] = {"inference": "transformers", "weight-sync": "monarch"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: stalwart bench <name> [options]\n\nbenchmarks:")
        for name, (_, summary) in BENCHMARKS.items():
            print(f"  {name:<12} {summary}")
        return 0
    name = argv[0]
    if name not in BENCHMARKS:
        print(f"stalwart bench: unknown benchmark '{name}' (choose from {', '.join(BENCHMARKS)})", file=sys.stderr)
        return 2
    if name in NEEDS and not any(a in ("-h", "--help") for a in argv[1:]):
        require(NEEDS[name], f"the {name} benchmark")
    return int(importlib.import_module(BENCHMARKS[name][0]).main(argv[1:]) or 0)
