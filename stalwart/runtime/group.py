"""Process groups and device meshes: the one place that creates them.

Every group's store listens on one address (``bound_tcp_store``: loopback for a single host, the
address the user gave across hosts; torch's own store binds every interface). Four ways in, one
``init_process_group`` under all of them:

- ``init_from_env``   a torchrun / elastic-agent worker (training, a ``serve --tp`` replica)
- ``join``            rank 0 of a small job serves the store (benchmarks, ``doctor``, spawned test workers)
- ``join_attempt``    an actor joining attempt N of a group whose store a controller owns (the
                      controller's trainers, RL's trainers): each attempt under its own key prefix
- ``cpu_group``       a side group on the host for host tensors (snapshot exchange, custom collectives)
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from stalwart.runtime.device import CPU_BACKEND, HOST, LOOPBACK, backend_for, is_accelerator, resolve_device
from stalwart.runtime.env import DistEnv
from stalwart.runtime.settings import launched_by_torchrun
from stalwart.runtime.standalone import wait_for_members


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


def controller_store(world_size: int, timeout_s: float, host: str = LOOPBACK) -> dist.TCPStore:
    """A store a controller serves for the actor groups it drives (on a free port of ``host``): it
    outlives any actor, so every attempt's group meets on it."""
    return bound_tcp_store(host, 0, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def init_group(device: torch.device, rank: int, world_size: int, store: dist.Store, timeout_s: float) -> None:
    """The default process group, on ``device``'s backend."""
    dist.init_process_group(backend=backend_for(device), store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s),
                            device_id=device if is_accelerator(device) else None)


def env_of_launcher(device_request: str | torch.device, setting: str = "--device") -> DistEnv:
    """This process's place as torchrun's environment gives it (one process when there is none), and
    its device; no group is made."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return DistEnv(rank, world, local_rank, local_world, resolve_device(device_request, local_rank, setting))


def init_from_env(device_request: str | torch.device, timeout_s: float = 1800.0, setting: str = "--device") -> DistEnv:
    """Join the job torchrun (or Stalwart's agent) started, when it started one (any world size)."""
    env = env_of_launcher(device_request, setting)
    if launched_by_torchrun() and not dist.is_initialized():
        store = None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # this job's rank 0 serves the store
            store = bound_tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                                    env.rank == 0, timedelta(seconds=timeout_s))
        if store is None:  # the agent's store, read from the environment
            dist.init_process_group(backend=backend_for(env.device), timeout=timedelta(seconds=timeout_s),
                                    device_id=env.device if is_accelerator(env.device) else None)
        else:
            init_group(env.device, env.rank, env.world_size, store, timeout_s)
    return env


def listen_on(host: str) -> None:
    """Let the sockets of the groups this process (and the workers it starts) makes listen on ``host``'s
    interface only, where it is loopback (gloo and NCCL otherwise take the address the machine's name
    resolves to); a choice already made in the environment (``*_SOCKET_IFNAME``) stands."""
    if host == LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def join(rank: int, world_size: int, addr: str, port: int, device: torch.device = HOST,
         timeout_s: float = 120.0) -> DistEnv:
    """Join a group whose store rank 0 serves on ``addr`` only (its sockets too, where it is loopback)."""
    listen_on(addr)
    store = bound_tcp_store(addr, port, world_size, rank == 0, timedelta(seconds=timeout_s))
    init_group(device, rank, world_size, store, timeout_s)
    return DistEnv.of(rank, world_size, device)


def join_attempt(rank: int, world_size: int, store_port: int, attempt: int, device: torch.device,
                 timeout_s: float, setup_s: float, host: str = LOOPBACK, scope: str = "") -> DistEnv:
    """Join attempt ``attempt`` of a group whose store a controller serves at ``host:store_port``.

    Each attempt uses its own key prefix (under ``scope``, where several groups share the store: an RL
    generator of several processes), so a rebuilt group never meets a dead one's keys. Every rank
    first waits (up to ``setup_s``) until all have arrived: a respawned actor takes far longer to start
    than a collective may wait (``timeout_s``). The controller abandons an attempt by setting
    ``attempt-N/abort``."""
    if dist.is_initialized():
        dist.destroy_process_group()
    listen_on(host)
    store = dist.TCPStore(host, store_port, world_size, False, timeout=timedelta(seconds=setup_s))
    prefix = dist.PrefixStore(f"{scope}attempt-{attempt}", store)
    wait_for_members(prefix, world_size, setup_s, f"process group {attempt}")
    init_group(device, rank, world_size, prefix, timeout_s)
    return DistEnv.of(rank, world_size, device)


def abandon_attempt(store: dist.Store, attempt: int) -> None:
    """Tell the actors still waiting to join ``attempt`` (see ``join_attempt``) that it is given up."""
    store.set(f"attempt-{attempt}/abort", "1")


def cpu_group(ranks: list[int] | None = None, **kwargs) -> dist.ProcessGroup:
    """A group over the host's backend (host tensors: snapshot exchange, custom collectives), whatever
    the default group's device."""
    return dist.new_group(ranks, backend=CPU_BACKEND, **kwargs)


def is_cpu_group(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group``'s collectives run on the host's backend alone."""
    return dist.get_backend(group) == CPU_BACKEND


def device_mesh(device: torch.device, shape: tuple[int, ...], names: tuple[str, ...]):
    """A named DeviceMesh over the default group's ranks, on ``device``'s type."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(torch.device(device).type, shape, mesh_dim_names=names)


def leave() -> None:
    """Destroy the default group, if there is one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
