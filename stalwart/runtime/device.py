"""Which device a role runs on, and the collective backend that goes with it.

``device = auto | cpu | cuda``: ``auto`` takes CUDA when the machine has it. Asking for a device the
machine lacks is a :class:`DeviceUnavailable` (a user error: one line, exit 2), never a traceback
from deep inside torch. A CUDA process group carries GPU tensors over NCCL and CPU tensors (barriers,
objects, host-side exchanges) over gloo, so both backends are named where both are needed.
"""

from __future__ import annotations

import torch

from stalwart.errors import UserError
from stalwart.runtime.settings import DEVICES, LOOPBACK

# Where host-side work happens whatever the device: random generators that must give the same numbers
# on every device (seeded initialisation, sampling), staging buffers, numpy views.
HOST = torch.device("cpu")
CPU_BACKEND = "gloo"
_ACCELERATOR_BACKEND = {"cuda": "nccl"}


class DeviceUnavailable(UserError):
    """The device asked for is not on this machine (or not for this many local processes)."""


def resolve_device(requested: str | torch.device, local_rank: int = 0, setting: str = "--device") -> torch.device:
    """The device for the process with ``local_rank`` on its host (selected as the current CUDA device).

    ``setting`` names the option the request came from, for the one-line error."""
    if isinstance(requested, torch.device):
        requested = requested.type
    kind = check_device(requested, local_rank + 1, setting)
    if kind == HOST.type:
        return HOST
    torch.cuda.set_device(local_rank)
    return torch.device(kind, local_rank)


def check_device(requested: str, local_processes: int = 1, setting: str = "--device") -> str:
    """The device type ``requested`` resolves to on this host for ``local_processes`` processes,
    checked without starting anything on it (a launcher's preflight, before its workers exist)."""
    if requested not in DEVICES:
        raise UserError(f"{setting} must be one of {', '.join(DEVICES)} (got {requested!r})")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else HOST.type
    if requested != HOST.type:
        if not torch.cuda.is_available():
            build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device is visible"
            raise DeviceUnavailable(f"{setting} {requested}: this machine has no CUDA device ({build}, torch "
                                    f"{torch.__version__}); set {setting} to cpu or auto")
        if local_processes > torch.cuda.device_count():
            raise DeviceUnavailable(f"{setting} {requested}: {local_processes} processes per host need a GPU "
                                    f"each, but this host has {torch.cuda.device_count()}")
    return requested


def is_accelerator(device: torch.device | str) -> bool:
    return torch.device(device).type != HOST.type


def backend_for(device: torch.device | str) -> str:
    """The process-group backend for a group whose collectives run on ``device``: gloo on the host;
    on an accelerator its own backend for device tensors plus gloo for host tensors."""
    kind = torch.device(device).type
    if kind == HOST.type:
        return CPU_BACKEND
    return f"{HOST.type}:{CPU_BACKEND},{kind}:{_ACCELERATOR_BACKEND[kind]}"


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the host)."""
    if is_accelerator(device):
        torch.cuda.synchronize(torch.device(device))


def max_memory_allocated(device: torch.device | str) -> int | None:
    """Peak bytes the device's allocator handed out, where it keeps count (None on the host)."""
    return int(torch.cuda.max_memory_allocated(torch.device(device))) if is_accelerator(device) else None


def total_memory(device: torch.device | str) -> int | None:
    """The accelerator's memory in bytes (None on the host: the caller reads the host's RAM)."""
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory) if is_accelerator(device) else None


def accelerator_name(device: torch.device | str) -> str | None:
    return torch.cuda.get_device_name(torch.device(device)) if is_accelerator(device) else None


def accelerator_in_use() -> bool:
    """Whether this process has started CUDA (so host copies may be pinned and must be synchronized)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def host_generator(seed: int) -> torch.Generator:
    """A seeded generator on the host: the same numbers whatever device the tensors end up on."""
    return torch.Generator(device=HOST).manual_seed(seed)
