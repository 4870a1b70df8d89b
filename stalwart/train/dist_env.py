"""A training worker's place under its launcher: die with it, how much memory a rank has, leave together.

The process group itself and the device come from ``stalwart.runtime``."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from stalwart.ft.runlock import LAUNCHER_PID_ENV
from stalwart.parallel.dims import replica_fits
from stalwart.runtime.device import total_memory
from stalwart.runtime.env import DistEnv


def memory_per_rank(env: DistEnv) -> int:
    """Bytes of memory one rank can use: its GPU's, or the host's RAM shared by the local ranks."""
    accelerator = total_memory(env.device)
    if accelerator is not None:
        return accelerator
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
    return int(ram) // max(env.local_world_size, 1)


def replica_fits_here(env: DistEnv, n_params: int) -> bool:
    """Whether ``parallelism.data_parallel = auto`` may replicate a model of ``n_params`` on this job."""
    return replica_fits(n_params, max(env.world_size // max(env.local_world_size, 1), 1), memory_per_rank(env))


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


def leave_together() -> None:
    """At the normal end of a job: every rank waits for the others (rank 0 may still be sampling or
    writing the summary), then the finished trainer's reference cycles (modules holding process groups,
    FSDP state, pending work and its tensors) are collected now, on this thread with the interpreter
    alive, so no gloo object is torn down during interpreter finalization or while a peer still talks."""
    import gc

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    gc.collect()


