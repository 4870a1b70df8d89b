"""Materialize a meta-device model and initialize it identically under every parallel layout.

Each parameter's full value is generated from a generator seeded by (seed, parameter name), then
the shard this rank owns is copied in. Parameter names are stable across layouts, so FSDP, TP, PP or
a single process all start from the same bits — the basis of the exact parity tests.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from stalwart.models.llama import pack_fused_weights
from stalwart.runtime.device import host_generator


def _full_value(kind: str, std: float, shape: torch.Size, seed: int, name: str) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    gen = host_generator((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(shape, generator=gen) * std


def _aliases(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(module, attribute, canonical name) for every parameter that is shared (e.g. tied embeddings)."""
    canonical: dict[int, str] = {}
    out = []
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            full = f"{mod_name}.{attr}" if mod_name else attr
            if id(p) in canonical:
                out.append((mod, attr, canonical[id(p)]))
            else:
                canonical[id(p)] = full
    return out


# Wrappers that insert themselves into parameter names; seeds use the canonical (unwrapped) name.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def materialize_and_init(model: nn.Module, device: torch.device, seed: int,
                         stages: list[nn.Module] | None = None) -> None:
    """Allocate ``model`` on ``device`` and initialise it. With pipeline parallelism ``model`` is the
    rank's container and ``stages`` the modules that share its submodules (each is materialized)."""
    for module in stages or [model]:
        aliases = _aliases(module)
        module.to_empty(device=device)
        # to_empty() gives each alias its own tensor; tie them again (FSDP2 keeps its own ties itself).
        for mod, attr, name in aliases:
            shared = module.get_parameter(name)
            if getattr(mod, attr) is not shared and type(shared) is nn.Parameter:
                setattr(mod, attr, shared)
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    spec = {canonical_name(k): v for k, v in model.init_spec().items()}
    for name, param in model.named_parameters():
        name = canonical_name(name)
        kind, std = spec[name]
        full = _full_value(kind, std, param.shape, seed, name)
        param.copy_(_local_shard(param, full))
    # The fused projections (q/k/v, gate/up) then read their weights in place instead of concatenating
    # them every forward; names, values and the checkpoint are unchanged.
    for module in stages or [model]:
        pack_fused_weights(module)


def _local_shard(param: torch.Tensor, full: torch.Tensor):
    try:
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:  # pragma: no cover - torch without distributed
        return full.to(param.device)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already holds the full value; slice locally, no communication.
        return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return full.to(param.device)
