"""One candidate parallel layout, and the training-job facts every model needs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from stalwart.planner.shapes import ModelShape


@dataclass(frozen=True)
class Layout:
    """Degrees multiply to the world size: dp * tp * pp * cp. Rank order, innermost first, is
    tp, cp, pp, dp (Llama 3's order): tp stays in a host, dp is the outermost, latency-tolerant."""

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    micro_batch: int = 1                 # sequences per micro-batch per data-parallel rank
    virtual_stages: int = 1              # interleaved chunks per pipeline rank
    schedule: str = "1f1b"               # 1f1b | interleaved | gpipe (ignored when pp == 1)
    ac: str = "none"                     # activation checkpointing: none | selective | op | full
    fsdp: bool = True                    # shard params/grads/optimizer over dp (ZeRO-3); else ZeRO-1
    ep: int = 1                          # expert parallel: routed experts split over ep of the dp ranks

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def describe(self) -> str:
        pp = f"pp{self.pp}" + (f"x{self.virtual_stages} {self.schedule}" if self.pp > 1 else "")
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return (f"{'fsdp' if self.fsdp else 'dp'}{self.dp}{ep} tp{self.tp} {pp} cp{self.cp} "
                f"mb{self.micro_batch} ac={self.ac}")


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    seq_len: int
    global_batch: int                    # sequences per optimizer step

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


def local_batch(w: Workload, lay: Layout) -> int:
    return w.global_batch // lay.dp


def micro_batches(w: Workload, lay: Layout) -> int:
    return local_batch(w, lay) // lay.micro_batch


def layers_per_stage(w: Workload, lay: Layout) -> int:
    """The most layers any pipeline rank holds (the slowest stage sets the pace)."""
    return math.ceil(w.shape.n_layers / lay.pp)


def invalid_reason(w: Workload, lay: Layout, gpus_per_host: int) -> str | None:
    """Why a layout cannot run at all (independent of memory), or None."""
    s = w.shape
    if w.global_batch % lay.dp:
        return f"global batch {w.global_batch} is not divisible by dp {lay.dp}"
    if local_batch(w, lay) % lay.micro_batch:
        return f"local batch {local_batch(w, lay)} is not divisible by micro-batch {lay.micro_batch}"
    if lay.tp > gpus_per_host or gpus_per_host % lay.tp:
        return f"tp {lay.tp} must divide the {gpus_per_host} GPUs of a host"
    if s.n_heads % lay.tp or s.n_kv_heads % lay.tp and lay.tp % s.n_kv_heads:
        return f"tp {lay.tp} does not split {s.n_heads} heads / {s.n_kv_heads} kv heads"
    if w.seq_len % (2 * lay.cp) and lay.cp > 1:
        return f"seq {w.seq_len} is not divisible by 2*cp"
    if lay.ep > 1 and (not s.is_moe or s.n_experts % lay.ep or lay.dp % lay.ep):
        return f"ep {lay.ep} needs a mixture of experts whose experts and dp {lay.dp} it divides"
    if lay.pp > s.n_layers:
        return f"pp {lay.pp} exceeds {s.n_layers} layers"
    if lay.pp == 1 and (lay.virtual_stages != 1 or lay.schedule != "1f1b"):
        return "virtual stages/schedules need pp > 1"
    if lay.pp > 1:
        if lay.schedule == "interleaved":
            if lay.virtual_stages < 2 or lay.virtual_stages > layers_per_stage(w, lay):
                return "interleaved needs 2 <= virtual stages <= layers per stage"
            if micro_batches(w, lay) % lay.pp:
                return "interleaved 1F1B needs micro-batches divisible by pp"
        elif lay.virtual_stages != 1:
            return f"{lay.schedule} has one stage per rank"
        if micro_batches(w, lay) < lay.pp:
            return f"{micro_batches(w, lay)} micro-batches cannot fill {lay.pp} stages"
    return None
