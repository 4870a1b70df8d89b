"""Standalone process groups: group objects outside torch's default world, met on a controller's store.

A role that already belongs to a default group (a trainer's data-parallel group) or to none (a
generator) can still exchange tensors with other roles over a group object of its own, created on
the store a controller serves, under a key prefix of its own (one per attempt: a group rebuilt after a
failure never meets a dead one's keys). Nothing is registered with ``torch.distributed``'s world, so
the default group, its collectives and its teardown are untouched; the object is used directly
(``group.send([t], dst, tag).wait()``) and dropped when done.

The backend follows the device: gloo on the host, NCCL on CUDA (tensors then live on the device).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from stalwart.runtime.device import LOOPBACK, is_accelerator


def connect_store(store_port: int, setup_s: float, host: str = LOOPBACK) -> dist.TCPStore:
    """A client of the store a controller serves at ``host:store_port``."""
    return dist.TCPStore(host, store_port, None, False, timeout=timedelta(seconds=setup_s))


def wait_for_members(store: dist.Store, world_size: int, setup_s: float, what: str) -> None:
    """Announce this process on ``store`` and wait (up to ``setup_s``) until ``world_size`` have: a
    respawned actor takes far longer to start than a collective may wait. The controller gives the
    attempt up by setting ``abort`` under the same prefix."""
    store.add("arrived", 1)
    deadline = time.monotonic() + setup_s
    while store.add("arrived", 0) < world_size:
        if store.check(["abort"]):
            raise RuntimeError(f"{what} was abandoned by the controller")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not every member arrived within {setup_s:g} s")
        time.sleep(0.02)


def standalone_group(store: dist.Store, prefix: str, rank: int, world_size: int, device: torch.device,
                     timeout_s: float, setup_s: float, host: str = LOOPBACK):
    """A group object of ``world_size`` members under ``prefix`` of ``store``, on ``device``'s backend.

    ``timeout_s`` bounds each operation on it; ``setup_s`` how long members wait for each other. The
    host backend's sockets listen on ``host``'s address only (loopback for members on one host)."""
    scoped = dist.PrefixStore(prefix, store)
    wait_for_members(scoped, world_size, setup_s, f"group {prefix}")
    timeout = timedelta(seconds=timeout_s)
    if is_accelerator(device):
        nccl = dist.ProcessGroupNCCL  # only in CUDA builds of torch
        options = nccl.Options()
        options._timeout = timeout
        return nccl(scoped, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(scoped, rank, world_size, options)


def abandon(store: dist.Store, prefix: str) -> None:
    """Tell members still waiting to form the group under ``prefix`` that it is given up."""
    store.set(f"{prefix}/abort", "1")
