"""The `stalwart plan` configuration tree; every field's help is what `stalwart plan --help` prints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from stalwart.config import ConfigError, option, section
from stalwart.planner.hardware import GPUS
from stalwart.planner.shapes import FLAVORS, ModelShape


@dataclass
class ModelSection:
    flavor: str = option(f"Model shape: {', '.join(FLAVORS)}.", "llama3-8B", choices=tuple(FLAVORS))
    dim: int = option("Override the hidden size (0 = the flavor's).", 0, min=0)
    n_layers: int = option("Override the number of transformer blocks (0 = the flavor's).", 0, min=0)
    n_heads: int = option("Override the attention heads (0 = the flavor's).", 0, min=0)
    n_kv_heads: int = option("Override the key/value heads (0 = the flavor's).", 0, min=0)
    ffn_hidden: int = option("Override the SwiGLU hidden size (0 = the flavor's).", 0, min=0)
    vocab_size: int = option("Override the vocabulary size (0 = the flavor's).", 0, min=0)


def apply_shape_overrides(base: ModelShape, m: ModelSection) -> ModelShape:
    """``base`` with the non-zero overrides of a model section, checked for consistency."""
    changes = {k: getattr(m, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size")
               if getattr(m, k)}
    shape = dataclasses.replace(base, **changes)
    if shape.dim % shape.n_heads or shape.n_heads % shape.n_kv_heads:
        raise ConfigError(f"model: dim {shape.dim}, heads {shape.n_heads}, kv heads {shape.n_kv_heads} "
                          "are inconsistent")
    return shape


@dataclass
class WorkloadSection:
    seq_len: int = option("Sequence length in tokens.", 8192, min=1)
    global_batch: int = option("Sequences per optimizer step (global_batch_tokens, if set, wins); 0 = scale "
                               "with the cluster: max(16, cluster.gpus / 4), e.g. 2048 on 8,192 GPUs (Llama 3 "
                               "405B's 16M tokens at seq 8192).", 0, min=0)
    global_batch_tokens: int = option("Tokens per optimizer step; 0 = use global_batch. Must be a multiple of "
                                      "seq_len.", 0, min=0)


@dataclass
class ClusterSection:
    gpus: int = option("GPUs to lay the job out on.", 8, min=1)
    gpu: str = option(f"GPU type: {', '.join(GPUS)} (peak bf16, HBM size and bandwidth in "
                      "stalwart/planner/hardware.py).", "H100", choices=tuple(GPUS))
    gpus_per_host: int = option("GPUs per host (one NVLink domain; tensor parallel stays inside it).", 8, min=1)
    nic_gbps: float = option("Scale-out network bandwidth per GPU, Gbit/s.", 400.0, min=1.0)
    pod_gpus: int = option("GPUs in one full-bisection network pod.", 3072, min=1)
    spine_oversubscription: float = option("Oversubscription between pods (Llama 3: 7).", 7.0, min=1.0)
    power_limit_w: float = option("GPU power cap in watts; 0 = the datasheet TDP.", 0.0, min=0.0)


@dataclass
class SearchSection:
    tp: list[int] = option("Tensor-parallel degrees to try.", factory=lambda: [1, 2, 4, 8])
    pp: list[int] = option("Pipeline-parallel degrees to try.", factory=lambda: [1, 2, 4, 8, 16, 32])
    cp: list[int] = option("Context-parallel degrees to try.", factory=lambda: [1, 2, 4, 8, 16])
    micro_batch: list[int] = option("Micro-batch sizes (sequences) to try.", factory=lambda: [1, 2, 4, 8])
    virtual_stages: list[int] = option("Interleaved virtual stages per pipeline rank to try.",
                                       factory=lambda: [1, 2, 4, 8])
    schedules: list[Literal["1f1b", "interleaved", "gpipe"]] = option(
        "Pipeline schedules to try.", factory=lambda: ["1f1b", "interleaved", "gpipe"])
    ac: list[Literal["none", "selective", "op", "full"]] = option(
        "Activation checkpointing modes to try (selective = recompute norms/SwiGLU; op = torchtitan's "
        "every-other-matmul; full = whole layers).", factory=lambda: ["none", "selective", "op", "full"])
    fsdp: list[bool] = option("Shard params/grads/optimizer over data parallel (true = FSDP/ZeRO-3, false = "
                              "replicated params with a sharded optimizer).", factory=lambda: [True, False])
    ep: list[int] = option("Expert-parallel degrees to try (mixture-of-experts shapes; each must divide the "
                           "experts and the data-parallel degree).", factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    compile: bool = option("Assume torch.compile-fused elementwise kernels.", True)
    async_tp: bool = option("Assume tensor-parallel collectives overlap with matmuls (async TP).", False)
    reduce_bytes: int = option("Bytes per element of the gradient reduction (4 = fp32, 2 = bf16).", 4,
                               choices=(2, 4))
    headroom_gb: float = option("GPU memory kept free for the CUDA context, NCCL buffers and fragmentation.",
                                4.0, min=0.0)
    top: int = option("Layouts to list.", 10, min=1)


@dataclass
class IslandsSection:
    """``stalwart plan --islands``: islands joined by a slow link (stalwart/planner/islands.py)."""

    count: int = option("Islands (each a job of its own; only the outer sync crosses the link).", 2, min=2)
    procs: int = option("Processes (GPUs) per island.", 1, min=1)
    link_mbit: float = option("Inter-island link bandwidth, Mbit/s each way.", 100.0, min=1e-3)
    latency_ms: float = option("Inter-island link latency, one way, ms.", 50.0, min=0.0)
    params: int = option("Parameters synced (0 = the model flavor's).", 0, min=0)
    step_s: float = option("Seconds of one inner step of an island without the link (measured: a run's "
                           "step_time_s); 0 = the planner's best layout for `procs` GPUs of cluster.gpu at "
                           "workload.global_batch sequences per island.", 0.0, min=0.0)
    inner_steps: list[int] = option("H values to compare (DiLoCo and streaming rows for each).",
                                    factory=lambda: [50, 100])
    fragments: int = option("Streaming: fragments P (streaming rows for each H that is a multiple of P).", 4,
                            min=1)
    overlap: int = option("Streaming: inner steps tau an exchange overlaps (below H / P).", 1, min=0)
    quantize: Literal["none", "bf16", "int8", "int4"] = option("Streaming: the outer gradient on the link.", "int4")
    diloco_quantize: Literal["none", "bf16", "int8", "int4"] = option("DiLoCo: the outer gradient on the link.",
                                                                     "none")
    block: int = option("Values per quantization scale (int8/int4).", 256, min=8)
    steps: int = option("Predict a run of this many steps from a fresh connection, its final sync included "
                        "(0 = the steady state).", 0, min=0)
    island_gbit: float = option("Bandwidth inside an island, Gbit/s: rank 0 broadcasts each sync's result to the "
                                "island's other processes (10 for an emulated host; NVLink-class for GPUs).", 10.0,
                                min=1e-3)
    congestion: Literal["bbr", "cubic"] = option("TCP congestion control on the link: 'bbr' keeps its window "
                                                 "across idle periods and paces; 'cubic' restarts slow start "
                                                 "after an idle retransmission timeout.", "bbr")


@dataclass
class PlanConfig:
    model: ModelSection = section(ModelSection, "Model shape.")
    workload: WorkloadSection = section(WorkloadSection, "Sequence length and batch.")
    cluster: ClusterSection = section(ClusterSection, "GPUs and network.")
    search: SearchSection = section(SearchSection, "The layouts to enumerate and the assumptions.")
    islands: IslandsSection = section(IslandsSection, "Islands joined by a slow link (`stalwart plan --islands`).")

    def __post_init__(self) -> None:
        w = self.workload
        if w.global_batch_tokens and w.global_batch_tokens % w.seq_len:
            raise ConfigError(f"workload.global_batch_tokens ({w.global_batch_tokens}) must be a multiple of "
                              f"workload.seq_len ({w.seq_len})")
        for name in ("tp", "pp", "cp", "micro_batch", "virtual_stages", "ep"):
            vals = getattr(self.search, name)
            if not vals or min(vals) < 1:
                raise ConfigError(f"search.{name} must list positive integers")
        for name in ("schedules", "ac", "fsdp"):
            if not getattr(self.search, name):
                raise ConfigError(f"search.{name} must not be empty")
        i = self.islands
        if not i.inner_steps or min(i.inner_steps) < 1:
            raise ConfigError("islands.inner_steps must list positive integers")
        streamed = [h for h in i.inner_steps if h % i.fragments == 0]
        if not streamed:
            raise ConfigError(f"islands.inner_steps: no H is a multiple of islands.fragments ({i.fragments}); "
                              "streaming syncs a fragment every H / fragments steps")
        for h in streamed:
            if i.overlap >= h // i.fragments:
                raise ConfigError(f"islands.overlap ({i.overlap}) must be below the {h // i.fragments} steps between "
                                  f"two fragments' syncs at H = {h}")
