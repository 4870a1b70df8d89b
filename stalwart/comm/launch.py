"""Start a small real gloo job on this machine: ``run_workers(fn, world_size, args)``.

Each worker is a spawned process with one thread that joins a gloo process group over a free local
TCP port, calls ``fn(rank, world_size, *args)`` and sends back its return value. The first worker
failure stops the job and is raised in the parent with the worker's traceback. Used by the tests and
by ``stalwart bench collectives``; ``fn`` must be importable (a module-level function).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bound_tcp_store(host: str, port: int, world_size: int | None = None, is_master: bool = False,
                    timeout: timedelta = timedelta(seconds=300), **kwargs) -> dist.TCPStore:
    """A ``TCPStore`` whose server listens on ``host``'s address only (torch's own binds every
    interface): 127.0.0.1 for a single-host run, the address the user gave across hosts."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout, **kwargs)
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(1024)
    kwargs.pop("master_listen_fd", None)
    bound_port = sock.getsockname()[1]
    # The store serves on this socket from now on: it owns the descriptor (detached, never closed here).
    return dist.TCPStore(host, bound_port, world_size, True, timeout, master_listen_fd=sock.detach(), **kwargs)


def join_gloo(rank: int, world_size: int, addr: str, port: int, timeout_s: float = 120.0) -> None:
    """Join a gloo group whose store rank 0 serves on ``addr`` only."""
    timeout = timedelta(seconds=timeout_s)
    store = bound_tcp_store(addr, port, world_size, rank == 0, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def init_gloo(rank: int, world_size: int, addr: str, port: int, timeout_s: float = 120.0) -> None:
    """Join a gloo group with one compute thread (the machine has few cores, the workers many)."""
    torch.set_num_threads(1)
    join_gloo(rank, world_size, addr, port, timeout_s)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        init_gloo(rank, world_size, "127.0.0.1", port)
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
