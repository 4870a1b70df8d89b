"""Published large-scale training throughput the planner is calibrated on and checked against.

Each row states only what its source states (model shape, GPUs, degrees, batch, sequence, the figure)
and where it comes from; the planner chooses what the source does not (micro-batch, virtual stages,
schedule, activation checkpointing where unstated) among layouts that fit. ``role``: ``fit`` rows set
the calibration constants (``calibration.py``), ``held_out`` rows never do: their error is the model's
honest error. ``error`` is the error the documentation reports for each row with the shipped constants
(predicted / published - 1); a test holds the model to it.

Metrics: ``tflops_per_gpu`` (the planner's convention, 6 (N - embedding) + 12 L h s FLOPs per token,
which Llama 3's table uses), ``tokens_per_s_per_gpu``, and ``megatron_tflops``: Megatron-LM's own count,
96 B s l h^2 (1 + s / 6h + V / 16 l h) FLOPs per step (full activation recomputation included), turned
into a step time and compared as that.

Megatron-LM's GPT shapes (GeLU MLP of 4h, multi-head attention, tied 51,200-token embeddings) are
written as the planner's SwiGLU shapes with the same weights per layer (ffn_hidden = 8h/3: three
h x 8h/3 matrices = two h x 4h ones) and as many key/value heads as heads.

Not typed in: MegaScale's scaling table (Jiang et al., 2024) — beyond its headline (55.2% MFU for a
175B model on 12,288 GPUs) its rows' batch sizes and layouts are not remembered exactly enough here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    role: str                       # "fit" | "held_out"
    gpu: str
    gpus: int
    seq_len: int
    global_batch: int               # sequences per step
    metric: str
    published: float
    error: float                    # reported error with the shipped constants
    flavor: str = ""                # a planner flavor, or the shape below
    shape: tuple[int, int, int, int, int, int] = (0, 0, 0, 0, 0, 0)   # dim, layers, heads, kv heads, ffn, vocab
    tie_embeddings: bool = False
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ac: tuple[str, ...] = ("none", "selective", "op", "full")
    fsdp: tuple[bool, ...] = (True, False)
    micro_batch: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    power_limit_w: float = 0.0
    nic_gbps: float = 400.0
    pod_gpus: int = 3072
    spine_oversubscription: float = 7.0
    extra: dict = field(default_factory=dict)


MEGATRON = "Narayanan et al. 2021 (Megatron-LM, SC21), Table 1: GPT, A100 80GB (Selene: 8 x 200 Gb/s HDR per node), " \
           "seq 2048, vocab 51,200, activation recomputation, TFLOP/s per GPU as the paper counts them"


def _gpt(name: str, role: str, heads: int, h: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
         tflops: float, error: float) -> Row:
    return Row(name, MEGATRON, role, "A100", gpus, 2048, batch, "megatron_tflops", tflops, error,
               shape=(h, layers, heads, heads, 8 * h // 3, 51200), tie_embeddings=True, tp=tp, pp=pp,
               ac=("full",), fsdp=(False,), nic_gbps=200.0, pod_gpus=4480, spine_oversubscription=1.0)


ROWS: tuple[Row, ...] = (
    # Megatron-LM weak scaling (Table 1): params, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU.
    _gpt("Megatron GPT 1.7B, 32 A100", "fit", 24, 2304, 24, 1, 1, 32, 512, 137, 0.193),
    _gpt("Megatron GPT 3.6B, 64 A100", "held_out", 32, 3072, 30, 2, 1, 64, 512, 138, 0.123),
    _gpt("Megatron GPT 7.5B, 128 A100", "fit", 32, 4096, 36, 4, 1, 128, 512, 142, 0.025),
    _gpt("Megatron GPT 18.4B, 256 A100", "held_out", 48, 6144, 40, 8, 1, 256, 1024, 135, 0.028),
    _gpt("Megatron GPT 39.1B, 512 A100", "fit", 64, 8192, 48, 8, 2, 512, 1536, 138, 0.001),
    _gpt("Megatron GPT 76.1B, 1024 A100", "held_out", 80, 10240, 60, 8, 4, 1024, 1792, 140, 0.004),
    _gpt("Megatron GPT 145.6B, 1536 A100", "fit", 96, 12288, 80, 8, 8, 1536, 2304, 148, -0.031),
    _gpt("Megatron GPT 310.1B, 1920 A100", "held_out", 128, 16384, 96, 8, 16, 1920, 2160, 155, -0.113),
    _gpt("Megatron GPT 529.6B, 2520 A100", "fit", 128, 20480, 105, 8, 35, 2520, 2520, 163, -0.144),
    _gpt("Megatron GPT 1008B, 3072 A100", "held_out", 160, 25600, 128, 8, 64, 3072, 3072, 163, -0.131),
    # Llama 3 (Dubey et al. 2024, Table 4): 405B on H100, 16M tokens per batch.
    Row("Llama 3 405B, 8,192 H100", "Dubey et al. 2024 (The Llama 3 Herd of Models), Table 4: TP8 CP1 PP16 DP64, "
        "seq 8,192, 16M tokens per batch, 430 TFLOP/s per GPU (43% BF16 MFU)", "fit", "H100", 8192, 8192, 2048,
        "tflops_per_gpu", 430.0, 0.0, flavor="llama3-405B", tp=8, pp=16, fsdp=(True,)),
    Row("Llama 3 405B, 16,384 H100", "Dubey et al. 2024, Table 4: TP8 CP1 PP16 DP128, seq 8,192, 16M tokens per "
        "batch, 400 TFLOP/s per GPU (41%)", "held_out", "H100", 16384, 8192, 2048, "tflops_per_gpu", 400.0, 0.004,
        flavor="llama3-405B", tp=8, pp=16, fsdp=(True,)),
    Row("Llama 3 405B, 16,384 H100, 131K context", "Dubey et al. 2024, Table 4: TP8 CP16 PP16 DP8, seq 131,072, "
        "16M tokens per batch, 380 TFLOP/s per GPU (38%)", "held_out", "H100", 16384, 131072, 128, "tflops_per_gpu",
        380.0, 0.144, flavor="llama3-405B", tp=8, pp=16, cp=16, fsdp=(True,)),
    # torchtitan's published Llama 3.1 8B figure (the planner's original third point).
    Row("torchtitan Llama 3.1 8B, 8 H100", "torchtitan docs/performance.md, table 1: FSDP + compile, local batch 2, "
        "seq 8,192, selective op AC, H100 96GB HBM2e at 500 W", "held_out", "H100-96G", 8, 8192, 16,
        "tokens_per_s_per_gpu", 6667.0, 0.072, flavor="llama3-8B", micro_batch=(2,), ac=("op",), fsdp=(True,),
        power_limit_w=500.0),
)
