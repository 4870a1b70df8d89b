"""``stalwart doctor``: a short per-rank health check (compute and communication) that flags outliers.

Spawns ``nproc`` local processes on gloo; each measures matmul GFLOP/s, all-reduce latency (one
element) and bandwidth (``mb`` MB), and a ring exchange with its neighbours (send to rank+1, receive
from rank-1). :func:`flag_outliers` (pure) compares each rank to the median. A supervisor calls
:func:`health_check` before restarting a job to decide which ranks (hosts) to exclude.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from stalwart.runtime.settings import LOOPBACK, free_port


def _timed(fn: Any, iters: int) -> float:
    fn()  # warm-up
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def _worker(rank: int, world: int, port: int, opts: dict[str, Any], q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    from stalwart.runtime.device import HOST
    from stalwart.runtime.group import join

    torch.set_num_threads(opts["threads"])
    try:
        join(rank, world, LOOPBACK, port, HOST, opts["timeout_s"])
        n = opts["matmul_n"]
        a, b = torch.randn(n, n), torch.randn(n, n)
        slow = opts.get("slow_rank") == rank

        def mm() -> None:
            torch.mm(a, b)
            if slow:
                time.sleep(opts.get("slow_sleep_s", 0.05))

        mm_s = _timed(mm, opts["iters"])
        res = {"rank": rank, "host": socket.gethostname(), "matmul_gflops": 2 * n ** 3 / mm_s / 1e9}
        small, big = torch.zeros(1), torch.zeros(opts["mb"] * 2 ** 20 // 4)
        dist.barrier()
        res["allreduce_latency_us"] = _timed(lambda: dist.all_reduce(small), opts["iters"] * 2) * 1e6
        t = _timed(lambda: dist.all_reduce(big), max(2, opts["iters"] // 2))
        # bus bandwidth of a ring all-reduce: 2 (N-1)/N bytes per byte of payload
        res["allreduce_busbw_gbs"] = big.numel() * 4 * 2 * (world - 1) / world / t / 1e9 if world > 1 else None
        if world > 1:
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            out, inp = torch.zeros(big.numel() // 4), torch.zeros(big.numel() // 4)

            def ring() -> None:
                reqs = [dist.isend(out, nxt), dist.irecv(inp, prv)]
                for r in reqs:
                    r.wait()

            dist.barrier()
            res["ring_gbs"] = out.numel() * 4 / _timed(ring, max(2, opts["iters"] // 2)) / 1e9
        allres: list[Any] = [None] * world
        dist.all_gather_object(allres, res)
        if rank == 0:
            q.put({"ok": True, "ranks": allres})
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 (reported to the parent)
        q.put({"ok": False, "rank": rank, "error": f"{type(e).__name__}: {e}"})


# metric -> True when higher is better
METRICS = {"matmul_gflops": True, "allreduce_latency_us": False, "allreduce_busbw_gbs": True, "ring_gbs": True}


def flag_outliers(ranks: list[dict[str, Any]], tolerance: float = 0.3, comm_factor: float = 2.0
                  ) -> list[dict[str, Any]]:
    """Ranks more than ``tolerance`` (a fraction) worse than the median in matmul speed, or worse by
    ``comm_factor`` (a ratio) in a communication metric, which is noisier and shared by peers (pure)."""
    flags = []
    for m, higher_better in METRICS.items():
        tol = tolerance if m == "matmul_gflops" else 1 - 1 / comm_factor
        vals = {r["rank"]: r[m] for r in ranks if r.get(m) is not None}
        if len(vals) < 2:
            continue
        med = statistics.median(vals.values())
        for rank, v in sorted(vals.items()):
            bad = v < med * (1 - tol) if higher_better else v > med / (1 - tol)
            if bad and med > 0:
                flags.append({"rank": rank, "metric": m, "value": v, "median": med,
                              "ratio": v / med})
    return flags


@dataclass
class HealthReport:
    ok: bool
    ranks: list[dict[str, Any]] = field(default_factory=list)
    flags: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def bad_ranks(self) -> list[int]:
        return sorted({f["rank"] for f in self.flags})


def health_check(nproc: int = 2, matmul_n: int = 512, mb: int = 4, iters: int = 10, threads: int = 1,
                 tolerance: float = 0.3, timeout_s: float = 60.0, slow_rank: int | None = None) -> HealthReport:
    """Run the check on ``nproc`` local processes. ``slow_rank`` injects a slow rank (for tests)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port(LOOPBACK)
    opts = {"matmul_n": matmul_n, "mb": mb, "iters": iters, "threads": threads, "timeout_s": timeout_s,
            "slow_rank": slow_rank}
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, opts, q), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    results, errors = None, []
    deadline = time.monotonic() + timeout_s + 30
    while results is None and time.monotonic() < deadline:
        try:
            msg = q.get(timeout=1.0)
        except Exception:  # noqa: BLE001 (queue.Empty)
            if all(not p.is_alive() for p in procs):
                break
            continue
        if msg["ok"]:
            results = msg["ranks"]
        else:
            errors.append(f"rank {msg['rank']}: {msg['error']}")
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
        elif p.exitcode and not errors and results is None:
            errors.append(f"a worker exited with code {p.exitcode}")
    if results is None:
        return HealthReport(False, errors=errors or ["timed out"])
    flags = flag_outliers(results, tolerance)
    return HealthReport(not flags and not errors, results, flags, errors)


def format_report(rep: HealthReport) -> str:
    cols = (("matmul_gflops", "matmul GFLOP/s", 15, 1), ("allreduce_latency_us", "allreduce us", 13, 1),
            ("allreduce_busbw_gbs", "busbw GB/s", 11, 2), ("ring_gbs", "ring GB/s", 10, 2))
    lines = [f"{'rank':>4} {'host':<14} " + " ".join(f"{title:>{w}}" for _, title, w, _ in cols)]
    for r in rep.ranks:
        cells = [f"{r[k]:{w}.{d}f}" if r.get(k) is not None else f"{'-':>{w}}" for k, _, w, d in cols]
        lines.append(f"{r['rank']:>4} {r['host'][:14]:<14} " + " ".join(cells))
    for fl in rep.flags:
        lines.append(f"OUTLIER rank {fl['rank']}: {fl['metric']} = {fl['value']:.3g} ({fl['ratio']:.2f}x the median "
                     f"{fl['median']:.3g})")
    lines += [f"ERROR {e}" for e in rep.errors]
    lines.append("healthy" if rep.ok else f"UNHEALTHY: rank(s) {rep.bad_ranks or '?'}")
    return "\n".join(lines)
