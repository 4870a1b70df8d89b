"""Where the processes of one host that share its GPUs run, and where tensors cross between them.

The single-controller roles (RL's trainers and generators) are processes of one host that may
outnumber its GPUs: they share them round-robin. Tensors between two processes travel on the
device (NCCL) only when every process of the exchange has a GPU of its own (NCCL refuses two ranks
on one GPU); otherwise through the host (gloo).
"""

from __future__ import annotations

import torch

from stalwart.runtime.device import HOST, check_device, is_accelerator, resolve_device


def shared_device(requested: str, index: int, setting: str = "--device") -> torch.device:
    """The device of the ``index``-th process of this host that runs on ``requested``: on an
    accelerator, GPU ``index`` modulo the GPUs there are (selected as the current device)."""
    kind = check_device(requested, 1, setting)
    if kind == HOST.type:
        return HOST
    return resolve_device(kind, index % torch.cuda.device_count(), setting)


def exchange_device(device: torch.device, processes: int) -> torch.device:
    """Where an exchange between ``processes`` processes on ``device`` (each the ``index``-th of
    :func:`shared_device`, ``0..processes-1``) carries its tensors: the device when each has its own."""
    if is_accelerator(device) and processes <= torch.cuda.device_count():
        return device
    return HOST
