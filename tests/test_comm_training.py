"""Data-parallel training with the custom gradient reduction gives the built-in's losses (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stalwart.comm import (
    Selector,
    flat_topology,
    reduce_gradients,
    register_selector_hook,
)
from stalwart.comm.launch import run_workers

pytestmark = pytest.mark.multiproc

STEPS = 6


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 4)  # 16*32+32 + 32*32+32 + 32*4+4 = 1732 parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, 16) -> (batch, 4)
        return self.head(self.body(x))


def _train(rank: int, mode: str) -> tuple[list[float], torch.Tensor]:
    torch.manual_seed(0)  # identical initial weights on every rank
    model = TinyNet()
    sel = None
    if mode.startswith("sel:"):
        algo = mode[4:]
        sel = Selector(flat_topology(dist.get_world_size()), fixed={} if algo == "auto" else {"all_reduce": algo})
    if mode.startswith("ddp"):
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)  # several buckets
        if mode == "ddp:hook":
            register_selector_hook(model, Selector(flat_topology(dist.get_world_size()), fixed={"all_reduce": "rhd"}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not mode.startswith("ddp"):
            # Small buckets so several all-reduces (and a not-divisible size) happen per step.
            reduce_gradients(model.parameters(), None, sel, op="avg", bucket_mb=0.004)
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return losses, flat


def train_modes(rank: int, world: int, modes: list[str]) -> dict[str, tuple[list[float], torch.Tensor]]:
    return {m: _train(rank, m) for m in modes}


def test_custom_reduction_matches_builtin_losses() -> None:
    modes = ["builtin", "sel:ring", "sel:rhd", "sel:dbtree", "sel:auto", "ddp:builtin", "ddp:hook"]
    per_rank = run_workers(train_modes, 2, (modes,), timeout_s=240)
    for rank, res in enumerate(per_rank):
        base_losses, base_params = res["builtin"]
        assert base_losses[-1] < base_losses[0]  # it trains
        for m in modes[1:]:
            losses, params = res[m]
            assert losses == pytest.approx(base_losses, rel=1e-6, abs=1e-7), (rank, m)
            assert torch.allclose(params, base_params, rtol=1e-6, atol=1e-7), (rank, m)
    # Replicas stay identical across ranks (the reduction gives every rank the same bits).
    for m in modes:
        assert torch.equal(per_rank[0][m][1], per_rank[1][m][1]), m
    # ...and the ranks really saw different data (otherwise the reduction would be untested).
    assert per_rank[0]["builtin"][0] != per_rank[1]["builtin"][0]
