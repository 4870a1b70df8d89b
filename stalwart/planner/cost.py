"""Step time of a layout from first principles: GEMM roofline with wave quantisation, flash attention,
memory-bound elementwise work, ring collectives per network tier, pipeline bubble and overlap.

Calibration constants (the only fitted numbers; everything else is a datasheet figure or a count):

* ``GPUSpec.gemm_efficiency`` (``hardware.py``, fitted per GPU generation by ``calibration.py``):
  fraction of the datasheet bf16 peak a large, well-shaped GEMM sustains in a training loop. The
  datasheet peak is at boost clock; sustained clocks under load are lower.
* ``ATTENTION_EFFICIENCY``: the same for fused (flash) attention, forward and backward together.
* ``MEMORY_EFFICIENCY``: achievable fraction of HBM bandwidth for streaming kernels.
* ``NETWORK_EFFICIENCY``: NCCL bus bandwidth as a fraction of the link (NVLink or NIC) bandwidth.
* ``DP_OVERLAP``: fraction of data-parallel traffic that can hide behind independent compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stalwart.planner.hardware import GPUSpec, clock_factor
from stalwart.planner.layout import Layout, Workload, layers_per_stage, micro_batches
from stalwart.planner.memory import Precision, expert_params_per_rank, params_per_rank

ATTENTION_EFFICIENCY = 0.35
MEMORY_EFFICIENCY = 0.80
NETWORK_EFFICIENCY = 0.75
DP_OVERLAP = 0.85

TILE_M, TILE_N = 128, 256          # Hopper/Ampere cuBLAS-style output tile (wave quantisation)


@dataclass(frozen=True)
class Network:
    gpus_per_host: int = 8
    nic_gbps: float = 400.0            # per GPU, Gbit/s (one NIC per GPU, rail-optimised)
    pod_gpus: int = 3072               # full-bisection domain (Llama 3: 3,072-GPU pods)
    spine_oversubscription: float = 7.0   # between pods (Llama 3: 1:7)
    nvlink_latency_us: float = 5.0
    net_latency_us: float = 15.0


@dataclass(frozen=True)
class Options:
    compile: bool = True               # fused elementwise kernels (fewer HBM round trips)
    async_tp: bool = False             # tensor-parallel collectives overlapped with GEMMs
    power_limit_w: float = 0.0         # 0 = datasheet TDP
    reduce_bytes: int = 4              # gradient reduction dtype (Llama 3 reduces in fp32)
    gemm_efficiency: float = 0.0       # 0 = the GPU's fitted value (GPUSpec.gemm_efficiency); the fit varies it


@dataclass(frozen=True)
class StepTime:
    compute_s: float                   # all micro-batches on the slowest rank, incl. recompute
    tp_s: float                        # exposed tensor-parallel communication
    cp_s: float                        # exposed context-parallel communication
    pp_s: float                        # exposed point-to-point (pipeline fill/drain)
    dp_s: float                        # exposed data-parallel / FSDP communication
    ep_s: float                        # expert-parallel all-to-all (dispatch + combine, fwd + bwd), exposed
    bubble_s: float                    # pipeline bubble
    optimizer_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float              # model FLOPs (flops_per_token convention) per second per GPU
    mfu: float
    tiers: dict[str, str]              # dimension -> network tier its collectives run on

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def gemm_s(m: float, k: float, n: float, peak: float, hbm: float) -> tuple[float, int]:
    """(roofline seconds, output tiles) of an (m x k) @ (k x n) bf16 GEMM."""
    flops = 2.0 * m * k * n
    tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N)
    return max(flops / peak, 2.0 * (m * k + k * n + m * n) / hbm), tiles


def _gemm(m: float, k: float, n: float, gpu: GPUSpec, peak: float, hbm: float) -> float:
    """Roofline time with wave quantisation: the output tiles run in waves of one tile per SM."""
    t, tiles = gemm_s(m, k, n, peak, hbm)
    waves = math.ceil(tiles / gpu.sms)
    return t * waves * gpu.sms / tiles        # the last, partial wave costs a full wave


def tier(group: int, stride: int, net: Network) -> str:
    span = group * stride
    if group == 1:
        return "-"
    if span <= net.gpus_per_host:
        return "nvlink"
    return "network" if span <= net.pod_gpus else "spine"


def collective_s(kind: str, nbytes: float, group: int, stride: int, gpu: GPUSpec, net: Network) -> float:
    """Ring all-gather / reduce-scatter (or all-reduce = both) of a tensor of ``nbytes`` in total.

    Across pods the collective is hierarchical: a ring inside each pod, then the pod-reduced shard
    (1/k of the data for k members per pod) crosses the oversubscribed spine.
    """
    if group <= 1 or nbytes <= 0:
        return 0.0
    t = tier(group, stride, net)
    nic = net.nic_gbps / 8.0 * 1e9 * NETWORK_EFFICIENCY
    if t == "nvlink":
        bw, lat = gpu.nvlink_gbps * 1e9 * NETWORK_EFFICIENCY, net.nvlink_latency_us * 1e-6
        one = (group - 1) / group * nbytes / bw + (group - 1) * lat
    elif t == "network":
        one = (group - 1) / group * nbytes / nic + (group - 1) * net.net_latency_us * 1e-6
    else:
        k = max(1, min(group, net.pod_gpus // stride))
        pods = math.ceil(group / k)
        inside = (k - 1) / k * nbytes / nic + (k - 1) * net.net_latency_us * 1e-6
        across = (pods - 1) / pods * (nbytes / k) / (nic / net.spine_oversubscription) \
            + (pods - 1) * net.net_latency_us * 1e-6
        one = inside + across
    return 2.0 * one if kind == "all_reduce" else one


def all_to_all_s(nbytes: float, group: int, stride: int, gpu: GPUSpec, net: Network) -> float:
    """Pairwise all-to-all in which each rank holds ``nbytes`` and keeps 1/group of it. Across pods the
    share bound for other pods crosses the oversubscribed spine."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    t = tier(group, stride, net)
    out = (group - 1) / group * nbytes
    nic = net.nic_gbps / 8.0 * 1e9 * NETWORK_EFFICIENCY
    if t == "nvlink":
        return out / (gpu.nvlink_gbps * 1e9 * NETWORK_EFFICIENCY) + (group - 1) * net.nvlink_latency_us * 1e-6
    lat = (group - 1) * net.net_latency_us * 1e-6
    if t == "network":
        return out / nic + lat
    k = max(1, min(group, net.pod_gpus // stride))  # members per pod
    across = (group - k) / group * nbytes
    return max((out - across) / nic, across / (nic / net.spine_oversubscription)) + lat


def _ffn_fwd(w: Workload, lay: Layout, n: float, gpu: GPUSpec, peak: float, hbm: float) -> tuple[float, float]:
    """(GEMM seconds, elementwise elements per token) of one layer's feed-forward, averaged over the layers.

    A sparse layer routes each of the ``n`` tokens to ``top_k`` experts; under expert parallelism a rank
    computes its ``experts / ep`` experts for the tokens of its whole ep group (balanced load assumed).
    NOTE: Stalwart computes the sparse block unsharded on every tp rank (experts are not tensor-parallel).
    """
    s, t, h, f = w.shape, lay.tp, w.shape.dim, w.shape.ffn_hidden
    dense_g = _gemm(n, h, 2 * f / t, gpu, peak, hbm) + _gemm(n, f / t, h, gpu, peak, hbm)
    if not s.is_moe:
        return dense_g, 3 * f / t
    he, k, local = s.expert_hidden, s.top_k, s.n_experts // lay.ep
    per_expert = n * k * lay.ep / s.n_experts  # tokens per local expert
    moe_g = local * (_gemm(per_expert, h, 2 * he, gpu, peak, hbm) + _gemm(per_expert, he, h, gpu, peak, hbm))
    moe_g += _gemm(n, h, s.n_experts, gpu, peak, hbm)  # router
    if s.n_shared:
        moe_g += _gemm(n, h, 2 * he * s.n_shared, gpu, peak, hbm) + _gemm(n, he * s.n_shared, h, gpu, peak, hbm)
    frac = s.n_sparse_layers / s.n_layers
    moe_elems = k * (3 * he + 4 * h) + 3 * he * s.n_shared   # SwiGLU + permutation copies
    return (1 - frac) * dense_g + frac * moe_g, (1 - frac) * 3 * f / t + frac * moe_elems


def step_time(w: Workload, lay: Layout, gpu: GPUSpec, net: Network = Network(), opt: Options = Options(),
              prec: Precision = Precision()) -> StepTime:
    s = w.shape
    h, kv = s.dim, s.kv_dim
    t = lay.tp
    peak = gpu.bf16_tflops * 1e12 * clock_factor(gpu, opt.power_limit_w)
    gemm_peak = peak * (opt.gemm_efficiency or gpu.gemm_efficiency)
    hbm = gpu.hbm_tbps * 1e12 * MEMORY_EFFICIENCY
    n = lay.micro_batch * w.seq_len / lay.cp                       # tokens per micro-batch per rank

    # --- one layer, one micro-batch, forward
    ffn_g, ffn_elems = _ffn_fwd(w, lay, n, gpu, gemm_peak, hbm)
    g_fwd = (_gemm(n, h, (h + 2 * kv) / t, gpu, gemm_peak, hbm) + _gemm(n, h / t, h, gpu, gemm_peak, hbm)
             + ffn_g)
    attn_fwd = 4.0 * n * (w.seq_len / 2.0) * h / t / (peak * ATTENTION_EFFICIENCY)   # causal half
    elems = (8 * h + 2 * kv) / t + ffn_elems * (1.0 if opt.compile else 5.0 / 3.0)
    if not opt.compile:
        elems += 4 * h / t
    ew_fwd = n * elems * prec.act_bytes / hbm
    fwd = g_fwd + attn_fwd + ew_fwd
    bwd = 2.0 * g_fwd + 2.5 * attn_fwd + 2.0 * ew_fwd
    recompute = {"none": 0.0, "selective": ew_fwd, "op": 0.5 * g_fwd + ew_fwd, "full": fwd}[lay.ac]

    # Tensor parallel (sequence parallel): 2 all-gathers + 2 reduce-scatters forward, as many backward.
    tp_one = collective_s("all_gather", n * h * prec.act_bytes, t, 1, gpu, net)
    tp_layer = (8 + (4 if lay.ac == "full" else 0)) * tp_one * (0.3 if opt.async_tp else 1.0)
    # Context parallel: all-gather K/V forward, reduce-scatter their gradients backward, hidden
    # behind the attention it feeds where possible.
    cp_bytes = n * lay.cp * 2 * kv * prec.act_bytes / t
    cp_comm = 2 * collective_s("all_gather", cp_bytes, lay.cp, t, gpu, net)
    cp_layer = max(0.0, cp_comm - (attn_fwd + 2.5 * attn_fwd))

    layers = layers_per_stage(w, lay)
    head_fwd = _gemm(n, h, s.vocab_size / t, gpu, gemm_peak, hbm)
    per_mb = layers * (fwd + bwd + recompute) + 3.0 * head_fwd
    per_mb_comm = layers * (tp_layer + cp_layer)
    m = micro_batches(w, lay)
    compute = m * per_mb
    if lay.pp == 1:
        bubble_units = 0.0
    elif lay.schedule == "interleaved":
        bubble_units = (lay.pp - 1) / lay.virtual_stages
    else:
        bubble_units = float(lay.pp - 1)
    bubble = bubble_units * (per_mb + per_mb_comm)
    p2p_bytes = n * h * prec.act_bytes / t
    pp_stride = t * lay.cp
    p2p = 0.0
    if lay.pp > 1:
        link = collective_s("all_gather", 2 * p2p_bytes, 2, pp_stride, gpu, net)   # one send ~ half a 2-rank AG
        p2p = 2 * (lay.pp - 1) * link

    # Data parallel: FSDP all-gathers params (per micro-batch, twice when resharding after forward,
    # i.e. without pp) and reduce-scatters gradients once per step; ZeRO-1 moves each once.
    local = params_per_rank(w, lay)
    dp_stride = t * lay.cp * lay.pp
    compute_bytes = prec.compute_bytes or prec.param_bytes
    ag = collective_s("all_gather", local * compute_bytes, lay.dp, dp_stride, gpu, net)
    rs = collective_s("reduce_scatter", local * opt.reduce_bytes, lay.dp, dp_stride, gpu, net)
    if lay.fsdp:
        gathers = 2 * m if lay.pp == 1 else 1
        dp_comm = gathers * ag + rs
    else:
        dp_comm = ag + rs
    if lay.pp == 1:
        # Overlapped with the layers' compute, except the first gather and the last reduction.
        dp = max(dp_comm / max(layers, 1), dp_comm - DP_OVERLAP * compute)
    else:
        # Only chunks other than the last can reduce while the pipeline is still computing.
        dp = dp_comm * (1.0 - DP_OVERLAP * (lay.virtual_stages - 1) / lay.virtual_stages)
    shard = local / lay.dp                  # optimizer state is sharded either way (ZeRO-1 or -3)
    optimizer = shard * (2 * prec.param_bytes + prec.grad_bytes + 2 * prec.optim_states * prec.optim_bytes
                         + compute_bytes) / hbm

    # Expert parallel: dispatch and combine all-to-alls of the k routed copies, forward and backward, in
    # every sparse layer; the ep group is the innermost part of dp. Not overlapped (Stalwart blocks on them).
    ep_stride = t * lay.cp * lay.pp
    ep = 0.0
    if s.is_moe and lay.ep > 1:
        sparse = layers * s.n_sparse_layers / s.n_layers
        ep = m * sparse * 4 * all_to_all_s(n * s.top_k * h * prec.act_bytes, lay.ep, ep_stride, gpu, net)
    # The experts' FSDP traffic runs over the dp / ep ranks outside the ep group.
    expert_local = expert_params_per_rank(w, lay)
    if expert_local and lay.dp // lay.ep > 1:
        e_ag = collective_s("all_gather", expert_local * compute_bytes, lay.dp // lay.ep, ep_stride * lay.ep,
                            gpu, net)
        e_rs = collective_s("reduce_scatter", expert_local * opt.reduce_bytes, lay.dp // lay.ep,
                            ep_stride * lay.ep, gpu, net)
        e_comm = (2 * m if lay.fsdp and lay.pp == 1 else 1) * e_ag + e_rs
        dp += max(e_comm / max(layers, 1), e_comm - DP_OVERLAP * compute) if lay.pp == 1 else \
            e_comm * (1.0 - DP_OVERLAP * (lay.virtual_stages - 1) / lay.virtual_stages)
    optimizer += expert_local / max(lay.dp // lay.ep, 1) * (2 * prec.param_bytes + prec.grad_bytes
                                                            + 2 * prec.optim_states * prec.optim_bytes
                                                            + compute_bytes) / hbm

    step = compute + m * per_mb_comm + bubble + p2p + dp + ep + optimizer
    tokens = w.tokens_per_step
    world = lay.world
    tflops = s.flops_per_token(w.seq_len) * tokens / step / world
    return StepTime(
        compute_s=compute, tp_s=m * layers * tp_layer, cp_s=m * layers * cp_layer, pp_s=p2p, dp_s=dp, ep_s=ep,
        bubble_s=bubble, optimizer_s=optimizer, step_s=step, tokens_per_s_per_gpu=tokens / step / world,
        tflops_per_gpu=tflops / 1e12, mfu=tflops / (gpu.bf16_tflops * 1e12),
        tiers={"tp": tier(t, 1, net), "cp": tier(lay.cp, t, net), "pp": tier(lay.pp, pp_stride, net),
               "dp": tier(lay.dp, dp_stride, net), "ep": tier(lay.ep, ep_stride, net)})
