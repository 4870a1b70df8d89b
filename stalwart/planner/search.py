"""Enumerate parallel layouts for a workload on a cluster, predict each, rank those that fit."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from stalwart.planner.cost import Network, Options, StepTime, step_time
from stalwart.planner.hardware import GPUSpec
from stalwart.planner.layout import Layout, Workload, invalid_reason
from stalwart.planner.memory import MemoryBreakdown, Precision, memory_per_rank


@dataclass(frozen=True)
class Space:
    """The choices to enumerate; a single-element tuple pins a dimension."""

    tp: tuple[int, ...] = (1, 2, 4, 8)
    pp: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    cp: tuple[int, ...] = (1, 2, 4, 8, 16)
    micro_batch: tuple[int, ...] = (1, 2, 4, 8)
    virtual_stages: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "gpipe")
    ac: tuple[str, ...] = ("none", "selective", "op", "full")
    fsdp: tuple[bool, ...] = (True, False)
    ep: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # only those valid for the shape are tried


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryBreakdown
    time: StepTime
    fits: bool


def enumerate_layouts(w: Workload, gpus: int, gpus_per_host: int, space: Space = Space()) -> list[Layout]:
    out = []
    for tp, pp, cp in itertools.product(space.tp, space.pp, space.cp):
        if gpus % (tp * pp * cp):
            continue
        dp = gpus // (tp * pp * cp)
        for mb, v, sched, ac, fsdp, ep in itertools.product(space.micro_batch, space.virtual_stages,
                                                             space.schedules, space.ac, space.fsdp, space.ep):
            if pp == 1 and (v != 1 or sched != "1f1b"):
                continue
            lay = Layout(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=mb, virtual_stages=v, schedule=sched, ac=ac,
                         fsdp=fsdp, ep=ep)
            if invalid_reason(w, lay, gpus_per_host) is None:
                out.append(lay)
    return out


def rank_layouts(w: Workload, gpus: int, gpu: GPUSpec, net: Network = Network(), opt: Options = Options(),
                 prec: Precision = Precision(), space: Space = Space(), headroom_gb: float = 4.0
                 ) -> list[Candidate]:
    """Every valid layout, fitting ones first, each group by tokens/s (then less memory)."""
    budget = (gpu.hbm_gb - headroom_gb) * 1e9
    cands = []
    for lay in enumerate_layouts(w, gpus, net.gpus_per_host, space):
        mem = memory_per_rank(w, lay, prec)
        cands.append(Candidate(lay, mem, step_time(w, lay, gpu, net, opt, prec), mem.total <= budget))
    cands.sort(key=lambda c: (not c.fits, -c.time.tokens_per_s_per_gpu, c.memory.total))
    return cands


def explain(c: Candidate, w: Workload, gpu: GPUSpec) -> list[str]:
    """Why the top layout wins, in a few lines: where the time goes and what memory holds."""
    t, m, lay = c.time, c.memory, c.layout
    parts = {"compute": t.compute_s, "tensor-parallel comm": t.tp_s, "context-parallel comm": t.cp_s,
             "pipeline bubble": t.bubble_s, "pipeline p2p": t.pp_s, "data-parallel comm": t.dp_s,
             "expert all-to-all": t.ep_s,
             "optimizer": t.optimizer_s}
    lines = [(f"{lay.describe()}: {t.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {t.tflops_per_gpu:.0f} TFLOP/s/GPU, "
             f"MFU {100 * t.mfu:.1f}%, step {t.step_s:.2f} s, {m.total / 1e9:.1f} of {gpu.hbm_gb:.0f} GB"),
             "  step time: " + ", ".join(f"{k} {100 * v / t.step_s:.1f}%" for k, v in parts.items() if v > 0),
             "  tiers: " + ", ".join(f"{k} on {v}" for k, v in t.tiers.items() if v != "-"),
             (f"  memory/GPU: params {m.params / 1e9:.1f} GB, grads {m.grads / 1e9:.1f}, optimizer "
             f"{m.optimizer / 1e9:.1f}, activations {m.activations / 1e9:.1f}, transient {m.transient / 1e9:.1f}")]
    if w.shape.is_moe:
        lines.append(f"  mixture of experts: {w.shape.active_params / 1e9:.1f}B of {w.shape.params / 1e9:.1f}B "
                     f"parameters active per token; ep{lay.ep} holds {w.shape.n_experts // lay.ep} experts per rank"
                     + (f", all-to-all {100 * t.ep_s / t.step_s:.1f}% of the step on {t.tiers['ep']}"
                        if lay.ep > 1 else ""))
    if lay.tp > 1:
        lines.append(f"  tp{lay.tp} stays inside a host's NVLink; it divides weights and activations by {lay.tp}.")
    if lay.pp > 1:
        lines.append(f"  pp{lay.pp} with {lay.virtual_stages} virtual stage(s): bubble "
                     f"{100 * t.bubble_s / t.step_s:.1f}% of the step.")
    if lay.ac != "none":
        lines.append(f"  activation checkpointing '{lay.ac}' is what makes the activations fit.")
    return lines
