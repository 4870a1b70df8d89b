"""`stalwart bench collectives`: measure every algorithm, fit the cost model, check the selector.

One gloo job (on loopback, or on emulated hosts in network namespaces with ``--netns.hosts N``) times
every algorithm of each collective over a size sweep; rank 0 then fits the alpha-beta-gamma
parameters of the tiers the job used (:mod:`stalwart.comm.calibrate`), prints bus bandwidth per size,
predicted vs measured time, and which algorithm the fitted selector picks against the measured best
and the built-in. ``--write_topology FILE`` saves the fitted topology for training (``comm.topology``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Literal

from stalwart.config import ConfigError, help_text, load, option, section


@dataclasses.dataclass
class NetnsConfig:
    """Emulated hosts: Linux network namespaces on a bridge with tc-shaped links (needs root)."""

    hosts: int = option("Number of emulated hosts; 0 runs every rank on this machine's loopback.", 0, min=0, max=16)
    rate_mbit: float = option("Bandwidth of each host's link to the switch, Mbit/s.", 1000.0, min=1.0)
    delay_ms: float = option("One-way added latency per link (only where the kernel has netem).", 0.5, min=0.0)


@dataclasses.dataclass
class BenchConfig:
    """Options of `stalwart bench collectives` (also readable from a TOML file with --config)."""

    world: int = option("Ranks (processes) on loopback; with netns, hosts * ranks_per_host.", 4, min=2, max=64)
    ranks_per_host: int = option("Ranks per emulated host (netns only).", 2, min=1, max=16)
    ops: list[str] = option("Collectives to measure: all_reduce, reduce_scatter, all_gather.",
                            factory=lambda: ["all_reduce"])
    algorithms: list[str] = option("Algorithms to measure (empty: all of each collective, built-in included).",
                                   factory=list)
    min_bytes: int = option("Smallest message, bytes.", 1024, min=4)
    max_bytes: int = option("Largest message, bytes (sizes grow by `step` up to it).", 16 << 20, min=4)
    step: int = option("Size multiplier between consecutive sizes.", 4, min=2)
    dtype: Literal["float32", "bfloat16"] = option("Element type.", "float32")
    iters: int = option("Timed iterations per point (fewer for slow points, see budget_s).", 20, min=1)
    budget_s: float = option("Approximate seconds to spend timing one (algorithm, size) point.", 1.0, min=0.01)
    topology: str = option("Topology TOML used as the fit's starting point and for tiers not measured.", "")
    write_topology: str = option("Write the fitted topology TOML here (empty: don't).", "")
    json_out: str = option("Write all measurements and predictions as JSON here (empty: don't).", "")
    netns: NetnsConfig = section(NetnsConfig, "Emulated multi-host network (network namespaces + tc).")


def sizes(cfg: BenchConfig) -> list[int]:
    out, s = [], cfg.min_bytes
    while s <= cfg.max_bytes:
        out.append(s)
        s *= cfg.step
    return out


def bus_factor(op: str, p: int) -> float:
    """Bus bandwidth = size / time * factor (NCCL-tests convention)."""
    return 2 * (p - 1) / p if op == "all_reduce" else (p - 1) / p


def measure(rank: int, world: int, cfg: BenchConfig, hosts: list[int]) -> list[dict] | None:
    """Worker body: time every (op, algorithm, size); rank 0 returns rows of median seconds."""
    import torch
    import torch.distributed as dist

    from stalwart.comm import collectives as coll
    from stalwart.comm.team import chunk_bounds
    from stalwart.comm.topology import Placement

    placement = Placement.from_hosts(hosts)
    dtype = getattr(torch, cfg.dtype)
    esize = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for op in cfg.ops:
        algos = [a for a in coll.ALGORITHMS[op] if not cfg.algorithms or a in cfg.algorithms]
        for nbytes in sizes(cfg):
            n = max(1, nbytes // esize)
            x = torch.randn(n).to(dtype)
            shard = x[:chunk_bounds(n, world)[rank][1]].clone()

            def call(algo: str, op: str = op, x: torch.Tensor = x, shard: torch.Tensor = shard, n: int = n) -> None:
                if op == "all_reduce":
                    coll.all_reduce(x, None, "sum", algo, placement)
                elif op == "reduce_scatter":
                    coll.reduce_scatter(x, None, "sum", algo, placement)
                else:
                    coll.all_gather(shard, n, None, algo, placement)

            first = torch.zeros(len(algos), dtype=torch.float64)
            for k, algo in enumerate(algos):  # warm-up; also sizes the number of iterations
                dist.barrier()
                t0 = time.perf_counter()
                call(algo)
                first[k] = time.perf_counter() - t0
                x.copy_(torch.randn(n).to(dtype))
            dist.all_reduce(first, op=dist.ReduceOp.MAX)
            iters = int(max(2, min(cfg.iters, cfg.budget_s / max(first.max().item(), 1e-6))))
            times = torch.zeros(len(algos), iters, dtype=torch.float64)
            # Algorithms interleave within each iteration, so a burst of load on a shared machine hits
            # them alike rather than whichever happened to run at the time.
            for i in range(iters):
                for k, algo in enumerate(algos):
                    dist.barrier()
                    t0 = time.perf_counter()
                    call(algo)
                    times[k, i] = time.perf_counter() - t0
                x.copy_(torch.randn(n).to(dtype))  # keep magnitudes bounded across repetitions
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # an iteration lasts until its slowest rank
            for k, algo in enumerate(algos):
                # NOTE: the minimum over iterations: interference from other work only ever adds time.
                rows.append({"op": op, "algorithm": algo, "bytes": n * esize, "seconds": float(times[k].min()),
                             "median_seconds": float(times[k].median()), "iters": iters})
    return rows if rank == 0 else None


def _print_table(rows: list[dict], world: int, selected: dict, predicted: dict) -> None:
    for op in sorted({r["op"] for r in rows}):
        algos = list(dict.fromkeys(r["algorithm"] for r in rows if r["op"] == op))
        print(f"\n{op}: bus bandwidth GB/s (time ms), world {world}")
        print(f"{'bytes':>10} " + " ".join(f"{a:>18}" for a in algos) + "   selected (pred ms) / best / vs builtin")
        by_size: dict[int, dict[str, float]] = {}
        for r in rows:
            if r["op"] == op:
                by_size.setdefault(r["bytes"], {})[r["algorithm"]] = r["seconds"]
        for nbytes, t in sorted(by_size.items()):
            cells = []
            for a in algos:
                s = t.get(a)
                cells.append(f"{nbytes / s * bus_factor(op, world) / 1e9:7.3f} ({s * 1e3:8.2f})" if s else " " * 18)
            sel = selected[(op, nbytes)]
            best = min(t, key=t.__getitem__)
            note = f"   {sel} ({predicted[(op, nbytes, sel)] * 1e3:.2f}) / {best} x{t[sel] / t[best]:.2f}"
            if "builtin" in t:
                note += f" / builtin x{t['builtin'] / t[sel]:.2f}"
            print(f"{nbytes:>10} " + " ".join(cells) + note)


def run(cfg: BenchConfig) -> dict:
    from stalwart.comm import calibrate
    from stalwart.comm.launch import run_workers
    from stalwart.comm.selector import Selector
    from stalwart.comm.topology import Topology, load_topology, write_topology

    notes: list[str] = []
    if cfg.netns.hosts:
        from stalwart.comm.netns import (
            NetnsCluster,
            run_workers_netns,
            unavailable_reason,
        )

        reason = unavailable_reason()
        if reason:
            raise ConfigError(f"--netns.hosts needs network namespaces: {reason}")
        world = cfg.netns.hosts * cfg.ranks_per_host
        hosts = [r // cfg.ranks_per_host for r in range(world)]
        with NetnsCluster(cfg.netns.hosts, cfg.netns.rate_mbit, cfg.netns.delay_ms) as cluster:
            notes += cluster.notes
            rows = run_workers_netns(measure, cluster, cfg.ranks_per_host, (cfg, hosts), timeout_s=3600)[0]
        rph = cfg.ranks_per_host
    else:
        world = cfg.world
        hosts = [0] * world
        rows = run_workers(measure, world, (cfg, hosts), timeout_s=3600)[0]
        rph = world
    prior = load_topology(cfg.topology) if cfg.topology else Topology(name="default")
    prior.ranks_per_host, prior.hosts_per_rack = rph, max(prior.hosts_per_rack, len(set(hosts)))
    fit = calibrate.fit(rows, prior, world)
    # Out-of-sample check: fit on every other size, predict the rest.
    all_sizes = sorted({r["bytes"] for r in rows})
    train = [r for r in rows if all_sizes.index(r["bytes"]) % 2 == 0]
    test = [r for r in rows if all_sizes.index(r["bytes"]) % 2 == 1]
    held = calibrate.fit(train, prior, world) if test else fit
    topo = fit.topology
    sel = Selector(topo, topo.place(world), candidates={op: tuple(sorted({r["algorithm"] for r in rows if r["op"] == op}))
                                                       for op in cfg.ops})
    members = list(range(world))
    predicted = {(r["op"], r["bytes"], r["algorithm"]): calibrate.predict_row(r, topo, world) for r in rows}
    selected = {(r["op"], r["bytes"]): sel.choose(r["op"], r["bytes"], members, world) for r in rows}
    _print_table(rows, world, selected, predicted)
    held_stats = calibrate.accuracy(test, held.topology, world) if test else fit.stats
    ratios, vs_builtin = [], []
    for (op, nbytes), a in selected.items():
        t = {r["algorithm"]: r["seconds"] for r in rows if r["op"] == op and r["bytes"] == nbytes}
        ratios.append(t[a] / min(t.values()))
        if "builtin" in t:
            vs_builtin.append(t["builtin"] / t[a])
    summary = {
        "world": world, "hosts": len(set(hosts)), "ranks_per_host": rph, "dtype": cfg.dtype,
        "fit_in_sample": fit.stats, "fit_held_out": held_stats,
        "selected_over_best_median": statistics.median(ratios), "selected_over_best_max": max(ratios),
        "points_within_10pct_of_best": sum(x <= 1.10 for x in ratios) / len(ratios),
        "builtin_over_selected_median": statistics.median(vs_builtin) if vs_builtin else None,
        "notes": notes,
    }
    print(f"\nfitted topology (tiers used: {', '.join(fit.tiers_used)}):")
    for t in fit.tiers_used:
        tier = getattr(topo.tiers, t)
        print(f"  {t}: latency {tier.latency_us:.1f} us, bandwidth {tier.bandwidth_gbps:.3f} GB/s")
    o = topo.overhead
    print(f"  gamma {topo.gamma_ns_per_byte:.3f} ns/B; overheads: step {o.step_us:.1f} us, message "
          f"{o.message_us:.1f} us, call {o.call_us:.1f} us, builtin step {o.builtin_step_us:.1f} us")
    for k, v in summary.items():
        if k != "notes":
            print(f"{k}: {v}")
    for n in notes:
        print(f"NOTE: {n}")
    if cfg.write_topology:
        write_topology(topo, cfg.write_topology)
        print(f"wrote {cfg.write_topology}")
    result = {"config": dataclasses.asdict(cfg), "rows": rows, "summary": summary,
              "selected": [{"op": k[0], "bytes": k[1], "algorithm": v} for k, v in selected.items()],
              "predicted": [{"op": k[0], "bytes": k[1], "algorithm": k[2], "seconds": v} for k, v in predicted.items()]}
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json_out).write_text(json.dumps(result, indent=1))
    return result


USAGE = """usage: stalwart bench collectives [--config FILE.toml] [--key value ...]

Times every collective algorithm over a size sweep, fits the cost model, reports the selector.
Examples:
  stalwart bench collectives --world 4 --max_bytes 16777216
  stalwart bench collectives --netns.hosts 2 --ranks_per_host 2 --netns.rate_mbit 500 \\
      --write_topology configs/topology/netns_fitted.toml
options:"""


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        print(help_text(BenchConfig))
        return 0
    file = None
    if argv[:1] == ["--config"] and len(argv) > 1:
        file, argv = argv[1], argv[2:]
    cfg = load(BenchConfig, file, argv)
    bad = [op for op in cfg.ops if op not in ("all_reduce", "reduce_scatter", "all_gather")]
    if bad:
        raise ConfigError(f"ops: unknown collective {bad[0]!r} (all_reduce, reduce_scatter, all_gather)")
    if cfg.max_bytes < cfg.min_bytes:
        raise ConfigError("max_bytes must be >= min_bytes")
    run(cfg)
    sys.stdout.flush()
    return 0
