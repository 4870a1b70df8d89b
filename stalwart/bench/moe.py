"""`stalwart bench moe`: the sparse feed-forward on this machine, in one process.

1. Expert computation: one grouped matmul over all experts vs a loop over the experts that have tokens,
   forward + backward of one debug-moe layer, with near-uniform routing and with routing collapsed onto
   two experts. The two variants run interleaved, every repeat printed.
2. Auxiliary-loss-free balancing on a skewed synthetic routing: max/mean expert load before and after
   ``--balance_steps`` bias updates, per seed.

Training throughput with and without expert parallelism is measured with ``stalwart train`` itself
(``tokens_per_s`` in the summary, ``moe_a2a_s`` per step in metrics.jsonl); see docs/moe.md.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from stalwart.config.arguments import ArgumentParser, at_least, positive
from stalwart.models.flavors import FLAVORS
from stalwart.models.moe import MoE, TopKRouter
from stalwart.runtime.device import DEVICES, HOST, resolve_device, synchronize
from stalwart.train.experts import imbalance, update_bias


def _layer(grouped: bool, collapse: bool, device: torch.device) -> MoE:
    args = FLAVORS["debug-moe"]
    moe = MoE(args.dim, dataclasses.replace(args.moe, grouped_mm=grouped), None)
    torch.manual_seed(0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    moe.reset_buffers()
    moe.to(device)
    if collapse:  # every token picks experts 0 and 1, as an unbalanced router ends up doing
        moe.router.expert_bias[:2] = 1.0
    return moe


def time_experts(tokens: int, repeats: int, iters: int, device: torch.device = HOST) -> dict[str, list[float]]:
    x = torch.randn(tokens // 128, 128, FLAVORS["debug-moe"].dim).to(device)
    out: dict[str, list[float]] = {}
    layers = {(g, c): _layer(g, c, device) for g in (True, False) for c in (False, True)}
    for _ in range(repeats):
        for (grouped, collapse), layer in layers.items():
            key = f"{'grouped' if grouped else 'loop'}, {'collapsed' if collapse else 'uniform'} routing"
            layer(x).sum().backward()  # warm-up
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                layer(x).square().mean().backward()
            synchronize(device)
            out.setdefault(key, []).append((time.perf_counter() - t0) / iters * 1e3)
    return out


def balance(seed: int, steps: int, rate: float) -> tuple[float, float]:
    torch.manual_seed(seed)
    router = TopKRouter(64, dataclasses.replace(FLAVORS["debug-moe"].moe))
    torch.nn.init.normal_(router.gate.weight, std=0.5)
    router.expert_bias.zero_()
    x = torch.randn(4096, 64) + 2.0 * router.gate.weight[seed % 8] / router.gate.weight[seed % 8].norm()

    def load() -> torch.Tensor:
        return torch.bincount(router(x)[1].flatten(), minlength=8)

    before = imbalance(load())
    for _ in range(steps):
        update_bias(router.expert_bias, load(), rate)
    return before, imbalance(load())


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=at_least(128), default=1024, help="tokens per forward (multiple of 128)")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--iters", type=at_least(1), default=20, help="forward+backward passes per timing")
    p.add_argument("--balance_steps", type=at_least(0), default=100)
    p.add_argument("--rate", type=positive, default=1e-3, help="bias update per step")
    p.add_argument("--device", default="auto", choices=DEVICES, help="where the expert layers run (auto = cuda if available)")
    a = p.parse_args(argv)
    if a.tokens % 128:
        p.error(f"--tokens must be a multiple of 128 (got {a.tokens})")
    device = resolve_device(a.device)
    print(f"expert computation, one debug-moe layer, {a.tokens} tokens, forward+backward ms on {device} "
          f"(torch threads: {torch.get_num_threads()}):")
    for key, ms in time_experts(a.tokens, a.repeats, a.iters, device).items():
        print(f"  {key:<30} " + "  ".join(f"{v:7.2f}" for v in ms) + f"   median {statistics.median(ms):.2f}")
    print(f"bias balancing on skewed synthetic routing ({a.balance_steps} updates of {a.rate:g}), max/mean load:")
    for seed in range(a.repeats):
        before, after = balance(seed, a.balance_steps, a.rate)
        print(f"  seed {seed}: {before:.3f} -> {after:.3f}")
    return 0
