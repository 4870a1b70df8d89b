"""Per-rank memory of a layout: parameters, gradients, optimizer state, activations.

A pure function of the shape, layout and precision so it can be checked against bytes Stalwart
measures on CPU (``Precision`` describes what a run keeps; the default is bf16 compute with fp32
master weights, fp32 gradients and AdamW's two fp32 moments, FSDP2's mixed-precision policy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stalwart.planner.layout import Layout, Workload, layers_per_stage, micro_batches


@dataclass(frozen=True)
class Precision:
    param_bytes: int = 4         # the stored (sharded) parameter: fp32 master
    compute_bytes: int = 2       # unsharded copy used in forward/backward (bf16); 0 = same as stored
    grad_bytes: int = 4          # reduced gradient (fp32)
    optim_states: int = 2        # AdamW: exp_avg, exp_avg_sq
    optim_bytes: int = 4         # per state element
    act_bytes: int = 2           # activations (bf16)


@dataclass(frozen=True)
class MemoryBreakdown:
    params: float                # bytes
    grads: float
    optimizer: float
    activations: float
    transient: float             # unsharded layer weights in flight (FSDP), logits, workspace
    params_per_rank: int

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def to_dict(self) -> dict[str, float]:
        return {**{k: v for k, v in self.__dict__.items()}, "total": self.total}


def params_per_rank(w: Workload, lay: Layout, first_stage: bool = True) -> int:
    """Parameters other than routed experts held by one (tp, pp) rank before data-parallel sharding
    (worst stage)."""
    s = w.shape
    n = layers_per_stage(w, lay) * s.layer_params
    if first_stage or lay.pp == 1:
        n += s.embedding_params
    if lay.pp == 1 or not first_stage:
        n += s.head_params
    return math.ceil(n / lay.tp)


def expert_params_per_rank(w: Workload, lay: Layout) -> int:
    """Routed-expert parameters of one rank before sharding over the dp / ep non-expert-parallel ranks.

    NOTE: Stalwart's experts are not tensor-parallel (each tp rank holds its ep share whole)."""
    s = w.shape
    if not s.is_moe:
        return 0
    return math.ceil(s.expert_params / s.n_layers * layers_per_stage(w, lay) / lay.ep)


def state_bytes(n_params: int, dp: int, fsdp: bool, prec: Precision = Precision()) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank for ``n_params`` model-parallel-local parameters.

    FSDP (ZeRO-3) shards all three over dp; plain data parallel with a distributed optimizer
    (ZeRO-1) keeps params and grads whole and shards the optimizer (and fp32 master) only.
    """
    opt = n_params * prec.optim_states * prec.optim_bytes
    if fsdp:
        return n_params * prec.param_bytes / dp, n_params * prec.grad_bytes / dp, opt / dp
    compute = prec.compute_bytes or prec.param_bytes
    master = n_params * prec.param_bytes / dp if prec.compute_bytes else 0.0
    return n_params * compute + master, n_params * prec.grad_bytes, opt / dp


def activation_bytes_per_token_layer(w: Workload, lay: Layout, prec: Precision = Precision()) -> float:
    """Saved activations of one layer per token (flash attention: no score matrix is stored).

    none: both norms' inputs and outputs, q/k/v, the attention output, w1/w3 outputs and the SwiGLU
    product (6 dim + 2 kv + 3 ffn); selective (Megatron-style): recompute norms and the SwiGLU
    product, keep the matmul outputs (4 dim + 2 kv + 2 ffn); op (torchtitan's op-level SAC): also
    drop every other matmul output (~3 dim + kv + ffn); full: only the layer input. Sharded by tp
    (sequence parallel) and, through the token count, by cp.
    """
    s = w.shape
    h, kv, ffn = s.dim, s.kv_dim, 3 * s.ffn_hidden  # ffn: the SwiGLU's saved elements per token
    sparse = 0.0
    if s.is_moe:
        # A sparse layer keeps k dispatched copies of the token (in and out) and k experts' SwiGLU
        # intermediates, plus the shared experts'; Stalwart computes it unsharded on every tp rank.
        moe = s.top_k * (2 * h + 3 * s.expert_hidden) + 3 * s.expert_hidden * s.n_shared
        sparse = s.n_sparse_layers / s.n_layers * {"none": moe, "selective": 2 * moe / 3, "op": moe / 3,
                                                     "full": 0.0}[lay.ac]
        ffn = ffn * s.n_dense_layers / s.n_layers
    elems = {"none": 6 * h + 2 * kv + ffn, "selective": 4 * h + 2 * kv + 2 * ffn / 3,
             "op": 3 * h + kv + ffn / 3, "full": h}[lay.ac]
    return (elems / lay.tp + sparse) * prec.act_bytes


def memory_per_rank(w: Workload, lay: Layout, prec: Precision = Precision()) -> MemoryBreakdown:
    """Peak bytes on the busiest rank (pipeline stage 0 holds the most in-flight activations)."""
    s = w.shape
    n = params_per_rank(w, lay)
    params, grads, opt = state_bytes(n, lay.dp, lay.fsdp, prec)
    n_exp = expert_params_per_rank(w, lay)
    if n_exp:  # experts: sharded over ep, the rest of their state over the dp ranks outside the ep group
        params, grads, opt = (a + b for a, b in zip((params, grads, opt),
                                                    state_bytes(n_exp, lay.dp // lay.ep, lay.fsdp, prec)))
    tokens_mb = lay.micro_batch * w.seq_len / lay.cp
    layers = layers_per_stage(w, lay)
    per_layer = activation_bytes_per_token_layer(w, lay, prec) * tokens_mb
    # Micro-batches' worth of stage activations held at the peak.
    if lay.pp == 1:
        in_flight = 1.0
    elif lay.schedule == "gpipe":
        in_flight = float(micro_batches(w, lay))
    elif lay.schedule == "interleaved":      # Megatron: p * (1 + (p-1)/(p*v))
        in_flight = lay.pp * (1 + (lay.pp - 1) / (lay.pp * lay.virtual_stages))
    else:                                    # 1F1B: stage 0 holds pp micro-batches
        in_flight = float(min(lay.pp, micro_batches(w, lay)))
    acts = per_layer * layers * in_flight
    # Recomputation re-materialises one layer's full activations at a time.
    if lay.ac != "none":
        full = Layout(dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, micro_batch=lay.micro_batch)
        acts += activation_bytes_per_token_layer(w, full, prec) * tokens_mb
    compute = prec.compute_bytes or prec.param_bytes
    transient = 0.0
    if lay.fsdp and lay.dp > 1:              # current + prefetched layer unsharded, and its grads
        transient += 2 * (s.layer_params / lay.tp + s.expert_params / max(s.n_layers, 1) / lay.ep) \
            * (compute + prec.grad_bytes)
    # Logits in fp32 for the loss (+ their gradient). NOTE: charged to the same worst rank as stage 0's
    # activations, which over-counts by a little when pp > 1 (they live on the last stage).
    transient += tokens_mb * s.vocab_size / lay.tp * 4 * 2
    return MemoryBreakdown(params, grads, opt, acts, transient, n + n_exp)
