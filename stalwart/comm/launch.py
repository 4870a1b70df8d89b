"""Start a small real host (gloo) job on this machine: ``run_workers(fn, world_size, args)``.

Each worker is a spawned process with one thread that joins a gloo process group over a free local
TCP port, calls ``fn(rank, world_size, *args)`` and sends back its return value. The first worker
failure stops the job and is raised in the parent with the worker's traceback. Used by the tests and
by ``stalwart bench collectives``; ``fn`` must be importable (a module-level function).
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stalwart.runtime.device import HOST, LOOPBACK
from stalwart.runtime.group import join
from stalwart.runtime.settings import free_port


def init_gloo(rank: int, world_size: int, addr: str, port: int, timeout_s: float = 120.0) -> None:
    """Join a host group with one compute thread (the machine has few cores, the workers many)."""
    torch.set_num_threads(1)
    join(rank, world_size, addr, port, HOST, timeout_s)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        init_gloo(rank, world_size, LOOPBACK, port)
        out = fn(rank, world_size, *args)
        # Plain pickle bytes: tensors through a torch.multiprocessing queue are shared-memory handles
        # that die with this process.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks; returns the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise RuntimeError(f"collective job timed out after {timeout_s:.0f}s "
                                   f"({len(out)}/{world_size} ranks finished)") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
