"""Process-group set-up from torchrun's environment; a single process needs none."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stalwart.comm.launch import bound_tcp_store
from stalwart.ft.runlock import LAUNCHER_PID_ENV
from stalwart.parallel.dims import replica_fits


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def memory_per_rank(env: DistEnv) -> int:
    """Bytes of memory one rank can use: its GPU's, or the host's RAM shared by the local ranks."""
    if env.device.type == "cuda":
        return int(torch.cuda.get_device_properties(env.device).total_memory)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
    return int(ram) // max(env.local_world_size, 1)


def replica_fits_here(env: DistEnv, n_params: int) -> bool:
    """Whether ``parallelism.data_parallel = auto`` may replicate a model of ``n_params`` on this job."""
    return replica_fits(n_params, max(env.world_size // max(env.local_world_size, 1), 1), memory_per_rank(env))


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def bind_to_launcher() -> None:
    """Under torch's elastic agent (torchrun or Stalwart's launcher), die with it: the kernel sends this
    worker SIGKILL when its parent exits, however it exits, so no worker trains on unsupervised. A
    worker whose launcher is already gone (or that is not the one it was started by) leaves at once."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import signal

    from stalwart.procs import die_with_parent

    die_with_parent(signal.SIGKILL)
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if os.getppid() == 1 or (expected and os.getppid() != int(expected)):
        print(f"stalwart train: the launcher that started this worker (PID {expected or '?'}) is gone; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("training.device = cuda, but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_request: str, timeout_s: float = 1800.0) -> DistEnv:
    """Initialise the default process group when launched by torchrun (any world size)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = pick_device(device_request, local_rank)
    if launched_by_torchrun() and not dist.is_initialized():
        # gloo carries CPU collectives (barriers, objects) even when NCCL carries the GPU ones.
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        store = None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # this job's rank 0 serves the store
            store = bound_tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                                    timedelta(seconds=timeout_s))
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), store=store,
                                rank=rank if store else -1, world_size=world if store else -1,
                                device_id=device if device.type == "cuda" else None)
    return DistEnv(rank, world, local_rank, local_world, device)


def leave_together() -> None:
    """At the normal end of a job: every rank waits for the others (rank 0 may still be sampling or
    writing the summary), then the finished trainer's reference cycles (modules holding process groups,
    FSDP state, pending work and its tensors) are collected now, on this thread with the interpreter
    alive, so no gloo object is torn down during interpreter finalization or while a peer still talks."""
    import gc

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    gc.collect()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
