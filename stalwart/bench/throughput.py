"""`stalwart bench throughput`: the reference training workload, 1 and 2 processes.

Reference workload (compared against other frameworks on the same machine): Llama-style, 4 layers,
dim 256, 4 heads, SwiGLU hidden 768, seq 256, micro-batch 8 per process, float32, AdamW, vocab 256
(byte-level), untied embeddings. The
step is Stalwart's own training core (``stalwart.train.core.TrainCore``, what `stalwart train` runs);
tokens are random bytes so the figure measures the training step, not the corpus.

Prints steady-state tokens/s, achieved GFLOP/s (model FLOPs, see flops_per_token), that as a fraction
of the measured matmul peak for the same thread count, and peak memory per process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import replace

from stalwart.config.arguments import ArgumentParser, at_least, listed
from stalwart.runtime.settings import DEVICES

REFERENCE = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=256, max_seq_len=256, ffn_hidden=768,
                 tie_embeddings=False)


def reference_args():
    """The reference workload's model (Llama-style; the same shape every peer in `bench peers` runs)."""
    from stalwart.models.flavors import FLAVORS

    return replace(FLAVORS["tiny"], **REFERENCE)


def _worker(rank: int, world: int, port: int, opts: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from stalwart.config.job import (CommConfig, OptimizerConfig, ParallelismConfig, SchedulerConfig,
                                     TrainingConfig)
    from stalwart.data.loader import Batch
    from stalwart.metrics.mfu import matmul_peak
    from stalwart.runtime.device import LOOPBACK, resolve_device, synchronize
    from stalwart.runtime.env import DistEnv
    from stalwart.runtime.group import join, leave
    from stalwart.train.core import CoreSpec, TrainCore

    torch.set_num_threads(opts["threads"])
    device = resolve_device(opts["device"], rank)
    if world > 1:
        join(rank, world, LOOPBACK, port, device, 1800.0)
    args = reference_args()
    mb, seq = opts["micro_batch"], args.max_seq_len
    total = opts["warmup"] + opts["steps"]
    # The training core `stalwart train` runs, fed random tokens: the same model, initialiser, FSDP2
    # wrapping, optimizer, clipping and step.
    elastic, layout = opts.get("elastic", False), opts.get("data_parallel", "auto")
    spec = CoreSpec(args, ParallelismConfig(dp_shard=-1, data_parallel="replicate" if elastic and layout == "auto"
                                            else layout,
                                            compile=opts.get("compile", False)),
                    CommConfig(), OptimizerConfig(lr=1e-3), SchedulerConfig(kind="constant", warmup_steps=0),
                    TrainingConfig(steps=total, global_batch=mb * world, micro_batch=mb, dtype="float32",
                                   device=device.type, elastic_exact=elastic), seq, accum_steps=1)
    started = time.perf_counter()
    core = TrainCore.build(spec, DistEnv.of(rank, world, device))
    gen = torch.Generator().manual_seed(rank)
    tokens = [torch.randint(0, 256, (mb, seq + 1), generator=gen).to(device) for _ in range(4)]
    batches = [[Batch(b[:, :-1], b[:, 1:])] for b in tokens]

    replicated = core.pm.replicated
    if replicated:
        from stalwart.parallel.replicate import exposed_all_reduce_ms, time_all_reduce

        time_all_reduce(core.pm.stages[0])
    for i in range(opts["warmup"]):
        core.train_step(batches[i % len(batches)])
        if i == 0:  # start-up: building the core and its first step (a compiled block's compile, cached or not)
            first_step_s = time.perf_counter() - started
    if world > 1:
        dist.barrier()
    synchronize(device)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(opts["steps"]):
        core.train_step(batches[i % len(batches)])
    synchronize(device)
    if world > 1:
        dist.barrier()
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    if opts.get("profile"):  # every rank steps (the collectives need them all); rank 0 records and prints
        _profile(core, batches, opts["profile"], record=rank == 0)
    n_tokens = opts["steps"] * mb * seq * world
    peak = matmul_peak(device, torch.float32).tflops * 1e12 if rank == 0 else 0.0  # cached per machine
    result = {"world": world, "threads_per_proc": opts["threads"], "tokens_per_s": n_tokens / elapsed,
              "gflops_per_s": n_tokens / elapsed * core.flops_per_token / 1e9,
              "peak_gflops_per_proc": peak / 1e9, "mem_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "step_s": elapsed / opts["steps"], "cpu_step_s": cpu_s / opts["steps"], "elastic_exact": elastic, "compiled": core.compiled,
              "startup_s": first_step_s,
              "layout": ("sharded (FSDP), elastic-exact tree reduce-scatter" if elastic and world > 1 and not replicated
                         and core.dims.dp_shard > 1 else
                         "replicated, elastic-exact tree sum" if elastic and world > 1 else
                         "replicated (DDP)" if replicated else "sharded (FSDP)" if world > 1 else "one process")
              + (" (elastic-exact)" if elastic and world == 1 else "")}
    if replicated:
        result.update(exposed_all_reduce_ms(core.pm.stages[0]))  # averaged over warm-up and timed steps
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(result, fh)
    leave()


def _profile(core, batches, steps: int, record: bool = True) -> None:
    """Print where one step's time goes (torch.profiler, self time per op, averaged over ``steps``);
    without ``record`` just run the steps (the other ranks of a profiled multi-process run)."""
    from torch.profiler import ProfilerActivity, profile

    if not record:
        for i in range(steps):
            core.train_step(batches[i % len(batches)])
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            core.train_step(batches[i % len(batches)])
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"profile: {total / 1e3 / steps:.1f} ms of op self time per step ({steps} steps)")
    for e in events[:25]:
        share = 100 * e.self_cpu_time_total / total
        print(f"  {e.key[:48]:<48} {e.self_cpu_time_total / 1e3 / steps:8.1f} ms {share:5.1f}%  x{e.count // steps}")


def run(world: int, opts: dict) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    from stalwart.comm.launch import free_port

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        port = free_port()
        if world == 1:
            _worker(0, 1, port, opts, out)
        else:
            mp.start_processes(_worker, args=(world, port, opts, out), nprocs=world, join=True, start_method="spawn")
        with open(out) as fh:
            return json.load(fh)


def elastic_cost(results: list[dict]) -> str:
    """Per process count: the elastic-exact step time over the default's, every pair and the median, in wall
    time and in rank 0's CPU seconds (the steadier figure on a loaded machine)."""
    import statistics

    lines = ["elastic-exact cost per step (elastic / default; wall time, then rank 0's CPU seconds):"]
    for world in sorted({r["world"] for r in results}):
        for key, what in (("step_s", "wall"), ("cpu_step_s", "cpu")):
            base = [r[key] for r in results if r["world"] == world and not r["elastic_exact"]]
            exact = [r[key] for r in results if r["world"] == world and r["elastic_exact"]]
            ratios = [e / b for b, e in zip(base, exact)]
            if ratios:
                lines.append(f"  {world} process{'es' if world > 1 else ''}, {what}: median "
                             f"{statistics.median(ratios):.3f}x ({', '.join(f'{x:.3f}' for x in ratios)})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart bench throughput", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=listed(at_least(1)), default="1,2", help="comma-separated process counts to measure")
    p.add_argument("--steps", type=at_least(1), default=20, help="timed steps")
    p.add_argument("--warmup", type=at_least(1), default=5, help="untimed warm-up steps")
    p.add_argument("--micro-batch", type=at_least(1), default=8)
    p.add_argument("--threads", type=at_least(0), default=0, help="threads per process (0 = cores / procs)")
    p.add_argument("--device", default="auto", choices=DEVICES, help="where to train (auto = cuda if available)")
    p.add_argument("--elastic", choices=("off", "on", "both"), default="off",
                   help="training.elastic_exact: off, on, or both interleaved (the default layout and the "
                        "world-size independent gradient sum, alternately, with the cost per step printed)")
    p.add_argument("--data-parallel", choices=("auto", "shard", "replicate"), default="auto",
                   help="parallelism.data_parallel of both variants (auto: the default picks, and elastic "
                        "replicates): 'shard' compares FSDP with and without elastic_exact")
    p.add_argument("--compile", choices=("off", "on", "both"), default="off",
                   help="parallelism.compile: eager, compiled blocks, or both interleaved (start-up = building "
                        "the core plus its first step, which includes the compile)")
    p.add_argument("--repeats", type=at_least(1), default=1, help="measure every configuration this many times")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--profile", type=at_least(0), default=0, metavar="STEPS",
                   help="after timing, profile this many steps on rank 0 and print the per-op breakdown")
    a = p.parse_args(argv)
    procs = a.procs
    from stalwart.runtime.device import check_device  # imports torch: after the flags are parsed

    kind = check_device(a.device, max(procs), "--device")
    cores = os.cpu_count() or 1
    results = []
    print(f"reference workload: 4 layers, dim 256, 4 heads, SwiGLU hidden 768, seq 256, micro-batch "
          f"{a.micro_batch}/process, fp32, AdamW, vocab 256; {cores} cores; device {kind}")
    print(f"{'procs':>5} {'thr/proc':>8} {'tokens/s':>10} {'GFLOP/s':>9} {'% of peak':>9} {'step s':>7} {'mem MiB':>8}  "
          "layout (gradient all-reduce ms/step: span, exposed after backward's compute)")
    modes = {"off": [False], "on": [True], "both": [False, True]}[a.elastic]
    compiles = {"off": [False], "on": [True], "both": [False, True]}[a.compile]
    for _ in range(a.repeats):
        for world in procs:
            threads = a.threads or max(1, cores // world)
            for elastic, compiled in [(e, c) for e in modes for c in compiles]:
                r = run(world, {"steps": a.steps, "warmup": a.warmup, "micro_batch": a.micro_batch,
                                "threads": threads, "profile": a.profile, "device": kind, "elastic": elastic,
                                "data_parallel": a.data_parallel,
                                "compile": compiled})
                frac = r["gflops_per_s"] / (r["peak_gflops_per_proc"] * world)
                r["fraction_of_peak"] = frac
                results.append(r)
                comm = f" ({r['all_reduce_ms']:.0f}, {r['exposed_ms']:.0f} exposed)" if "exposed_ms" in r else ""
                comm += f", compiled (start-up {r['startup_s']:.1f} s)" if compiled else ""
                print(f"{world:>5} {threads:>8} {r['tokens_per_s']:>10.0f} {r['gflops_per_s']:>9.1f} "
                      f"{100 * frac:>8.1f}% {r['step_s']:>7.3f} {r['mem_mib']:>8.0f}  {r['layout']}{comm}", flush=True)
    if a.elastic == "both":
        print(elastic_cost(results))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
