"""Placement of an inference server: tensor parallel x pipeline parallel x replicas on a set of hosts.

Pure functions of a model shape, the hosts and the traffic; no I/O, no clocks. For each placement the
planner predicts the weight shard and paged KV cache per device, the decode step (a roofline of the
matmul FLOPs against the weight and KV bytes every step reads, the host's own work for the step, plus
tensor-parallel all-reduces and pipeline sends), the time to first token and the output tokens/s of all
replicas, ranks the placements by the target and says in a few lines why the winner wins.

The host's work (``HostSpec.host_*``): dispatching each layer's operators, a step's scheduling, head and
sampling, and each sequence's token (sampled, detokenized, streamed to its client). On a CPU it runs on
the cores that compute, so it adds to the roofline; on an accelerator it overlaps the device's work
(launches are asynchronous), so the step takes the longer of the two. For a small model these fixed
costs are the step: without them the plan was 60x-660x off on the CPU (docs/serving.md, Placement).

Model of a replica (tp ranks per stage, pp stages, consecutive devices; tp groups never cross a host):

* every device holds its stage's layers split tp ways, and the KV cache of those layers for every
  token the replica serves, so all devices of a replica hold the same number of KV tokens;
* a decode step runs the stages one after another (plain pipeline parallel, no micro-batching), so pp
  adds memory, not speed: it never lowers the time per output token;
* continuous batching without chunked prefill: each new sequence's prefill stalls the decode batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from stalwart.config import ConfigError
from stalwart.models.flavors import TransformerArgs
from stalwart.planner.cost import MEMORY_EFFICIENCY, NETWORK_EFFICIENCY, Network
from stalwart.planner.hardware import GPUS
from stalwart.planner.layout import Layout, Workload
from stalwart.planner.memory import params_per_rank
from stalwart.planner.shapes import ModelShape

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class HostSpec:
    """Identical hosts; figures are sustained (already derated from the datasheet) and per device."""

    name: str
    hosts: int
    procs_per_host: int                  # devices (one serving process each) per host
    memory_gb: float                     # memory per device, GB (1e9 bytes)
    headroom_gb: float                   # kept free per device: runtime, activations, fragmentation
    flops_per_s: float                   # sustained matmul FLOP/s per device
    memory_gb_per_s: float               # sustained memory bandwidth per device
    intra_host_gb_per_s: float           # link between two devices of one host
    intra_host_latency_us: float
    inter_host_gb_per_s: float           # link between hosts, per device
    inter_host_latency_us: float
    # The host's work per forward pass (measured, docs/serving.md): per layer, plus per sequence and layer
    # (attention's per-sequence bookkeeping); per step (scheduling, the head, the sampler's loop); per
    # sequence and step (its token sampled, detokenized and streamed to the client).
    host_layer_us: float = 0.0
    host_seq_layer_us: float = 0.0
    host_step_us: float = 0.0
    host_token_us: float = 0.0
    host_overlaps: bool = True           # the host's work overlaps the device's (an accelerator), else adds

    @property
    def devices(self) -> int:
        return self.hosts * self.procs_per_host


def host_presets() -> dict[str, HostSpec]:
    """`cpu`: one 2-core VM with ~24 GB, a process per core; one GPU preset per planner GPU type with
    NVLink inside a host and a NIC per GPU between hosts, derated by the training cost model's
    efficiencies so that both planners read the same hardware the same way."""
    net = Network()
    # cpu: measured on that VM (2026-11-28, one thread, idle): an engine step of the debug model (dim 64)
    # with 2 and 6 layers at batch 1 and 32 gives 480 us per layer, 9 us per sequence and layer, 280 us per
    # step and 29 us per sequence; `stalwart serve` with 1 and 32 greedy streams (OpenAI's client on the
    # same cores) adds 240 us per step and 360 us per streamed token; a gloo all-reduce of 64 floats
    # between two processes takes 597 us (median; 4.1 ms at p90), i.e. 300 us per ring hop (between hosts
    # not measured: taken as no lower).
    out = {"cpu": HostSpec("2-core CPU VM", hosts=1, procs_per_host=2, memory_gb=10.0, headroom_gb=1.0,
                           flops_per_s=50e9, memory_gb_per_s=10.0, intra_host_gb_per_s=5.0,
                           intra_host_latency_us=300.0, inter_host_gb_per_s=10.0 / 8, inter_host_latency_us=300.0,
                           host_layer_us=480.0, host_seq_layer_us=9.0, host_step_us=520.0, host_token_us=390.0,
                           host_overlaps=False)}
    for key, gpu in GPUS.items():
        # No host terms: the GPU presets plan an engine whose host keeps ahead of the device (CUDA graphs,
        # as vLLM's). Stalwart's eager engine does not: on one H200 (docs/gpu.md) the 125M model's decode
        # step took 5.8 ms at batch 1 for 12 layers against a 0.1 ms roofline, about 450 us of host work
        # per layer; plan it with --hosts.host_layer_us 450 (docs/serving.md, Placement).
        out[key.lower()] = HostSpec(
            gpu.name, hosts=1, procs_per_host=net.gpus_per_host, memory_gb=gpu.hbm_gb, headroom_gb=4.0,
            flops_per_s=gpu.bf16_tflops * 1e12 * gpu.gemm_efficiency,
            memory_gb_per_s=gpu.hbm_tbps * 1e3 * MEMORY_EFFICIENCY,
            intra_host_gb_per_s=gpu.nvlink_gbps * NETWORK_EFFICIENCY, intra_host_latency_us=net.nvlink_latency_us,
            inter_host_gb_per_s=net.nic_gbps / 8 * NETWORK_EFFICIENCY, inter_host_latency_us=net.net_latency_us)
    return out


@dataclass(frozen=True)
class ServingRequest:
    """What the server must hold and what it is judged on."""

    context_tokens: int                  # the longest sequence (prompt + output) one request may reach
    prompt_tokens: int                   # mean prompt length
    output_tokens: int                   # mean output length
    param_bytes: int = 2                 # bytes per weight
    kv_bytes: int = 2                    # bytes per KV cache element (activations use param_bytes)
    target: str = "throughput"           # latency | throughput
    max_tpot_ms: float = 0.0             # bound on the time per output token; 0 = none
    max_batch: int = 256                 # the engine's cap on concurrent sequences per replica


@dataclass(frozen=True)
class Placement:
    """One candidate and its predictions; per device figures are for the busiest pipeline stage."""

    tp: int
    pp: int
    replicas: int
    fits: bool
    reason: str                          # why it does not fit ("" when it does)
    weight_bytes_per_device: float
    kv_bytes_per_token_per_device: float
    kv_tokens_per_device: int            # = KV tokens per replica (every stage holds all of them)
    max_batch: int                       # sequences of prompt + output tokens the KV cache holds
    batch: int                           # concurrent sequences per replica the throughput is quoted at
    batch_limit: str                     # what stops the batch growing: kv memory | max_batch | max_tpot
    ttft_s: float                        # prefill of the mean prompt, alone
    tpot_batch1_s: float                 # decode step at batch 1
    tp_comm_batch1_s: float              # all-reduce time inside `tpot_batch1_s`
    tpot_s: float                        # decode step at `batch`
    tp_comm_s: float                     # all-reduce time inside `tpot_s`
    pp_comm_s: float                     # stage-to-stage sends inside `tpot_s`
    tokens_per_s: float                  # output tokens/s of all replicas at `batch`

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ServingPlan:
    ranked: list[Placement]              # placements that fit and meet max_tpot_ms, best first
    rejected: list[Placement]            # placements that do not fit, with their reason
    why: list[str]


def shape_from_args(args: TransformerArgs) -> ModelShape:
    """The planner's view of a model built from Stalwart's own flavor arguments."""
    return ModelShape(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                      ffn_hidden=args.ffn_hidden, vocab_size=args.vocab_size, tie_embeddings=args.tie_embeddings)


def tp_invalid_reason(shape: ModelShape, hosts: HostSpec, tp: int) -> str | None:
    """Why a tensor-parallel degree cannot be used at all: it must split the KV heads (and so the
    query heads) evenly and its ranks must share a host."""
    if shape.n_kv_heads % tp or shape.n_heads % tp:
        return f"tp={tp} does not divide {shape.n_heads} heads / {shape.n_kv_heads} kv heads"
    if hosts.procs_per_host % tp:
        return f"tp={tp} does not divide the {hosts.procs_per_host} processes of a host"
    return None


def ring_all_reduce_s(nbytes: float, group: int, gb_per_s: float, latency_us: float) -> float:
    """Ring all-reduce (reduce-scatter + all-gather): 2 (n-1)/n of the message per link, 2 (n-1) hops."""
    if group <= 1:
        return 0.0
    return 2 * (group - 1) / group * nbytes / (gb_per_s * 1e9) + 2 * (group - 1) * latency_us * 1e-6


def stage_boundaries(hosts: HostSpec, tp: int, pp: int, replicas: int) -> tuple[int, int]:
    """(intra-host, inter-host) stage boundaries of the worst replica; replicas sit on consecutive
    devices, a stage on tp consecutive devices."""
    worst = (pp - 1, 0)
    for r in range(replicas):
        starts = [(r * pp + s) * tp for s in range(1, pp)]
        crossing = sum(1 for d in starts if d % hosts.procs_per_host == 0)
        worst = max(worst, (pp - 1 - crossing, crossing), key=lambda x: x[1])
    return worst


def _roofline_s(flops: float, nbytes: float, hosts: HostSpec) -> float:
    return max(flops / hosts.flops_per_s, nbytes / (hosts.memory_gb_per_s * 1e9))


def host_s(shape: ModelShape, hosts: HostSpec, seqs: int) -> float:
    """The host's seconds for one forward pass over ``seqs`` sequences, each emitting a token: every layer
    is dispatched once per step (by each tensor-parallel rank at once; by each pipeline stage in turn, so
    all layers count whatever pp is)."""
    per_layer = hosts.host_layer_us + seqs * hosts.host_seq_layer_us
    return 1e-6 * (shape.n_layers * per_layer + hosts.host_step_us + seqs * hosts.host_token_us)


def step_s(shape: ModelShape, hosts: HostSpec, req: ServingRequest, tp: int, pp: int, replicas: int,
           tokens: int, context: float, seqs: int | None = None) -> tuple[float, float, float]:
    """(total, tp comm, pp comm) seconds of one forward over `tokens` new tokens of `seqs` sequences
    (default `tokens`: a decode step; a prefill is one sequence's prompt), each attending to `context`
    tokens.

    Every stage reads its weight shard once and the KV of every attended token; stages run one after
    another, so the per-layer cost is summed over all layers whatever pp is. The host's work
    (``host_s``) adds to the device's on a CPU and overlaps it on an accelerator.
    """
    h, f = shape.dim, shape.ffn_hidden
    layer_flops = 2 * tokens * (h * (h + 2 * shape.kv_dim) + h * h + 3 * h * f) + 4 * tokens * context * h
    layer_bytes = shape.layer_params * req.param_bytes + tokens * context * 2 * shape.kv_dim * req.kv_bytes
    head_flops = 2 * tokens * shape.vocab_size * h
    compute = (shape.n_layers * _roofline_s(layer_flops / tp, layer_bytes / tp, hosts)
               + _roofline_s(head_flops / tp, shape.vocab_size * h * req.param_bytes / tp, hosts))
    host = host_s(shape, hosts, tokens if seqs is None else seqs)
    compute = max(compute, host) if hosts.host_overlaps else compute + host
    message = tokens * h * req.param_bytes
    tp_comm = 2 * shape.n_layers * ring_all_reduce_s(message, tp, hosts.intra_host_gb_per_s,
                                                     hosts.intra_host_latency_us)
    intra, inter = stage_boundaries(hosts, tp, pp, replicas)
    pp_comm = (intra * (message / (hosts.intra_host_gb_per_s * 1e9) + hosts.intra_host_latency_us * 1e-6)
               + inter * (message / (hosts.inter_host_gb_per_s * 1e9) + hosts.inter_host_latency_us * 1e-6))
    return compute + tp_comm + pp_comm, tp_comm, pp_comm


def evaluate(shape: ModelShape, hosts: HostSpec, req: ServingRequest, tp: int, pp: int) -> Placement:
    """Predict one (tp, pp) placement, with as many replicas as the devices hold."""
    replicas = hosts.devices // (tp * pp)
    lay, w = Layout(dp=1, tp=tp, pp=pp), Workload(shape, req.context_tokens, 1)
    params = max(params_per_rank(w, lay, first_stage=True), params_per_rank(w, lay, first_stage=False))
    weights = params * req.param_bytes
    kv_per_token = 2 * math.ceil(shape.n_layers / pp) * shape.kv_dim / tp * req.kv_bytes
    free = (hosts.memory_gb - hosts.headroom_gb) * 1e9 - weights
    kv_tokens = max(0, int(free // kv_per_token))
    seq_tokens = req.prompt_tokens + req.output_tokens
    max_batch = kv_tokens // seq_tokens
    reason = ""
    if free <= 0:
        reason = (f"weights {weights / 1e9:.2f} GB do not fit in one {hosts.memory_gb:.1f} GB device "
                  f"({hosts.headroom_gb:.1f} GB headroom)")
    elif kv_tokens < req.context_tokens:
        reason = (f"after {weights / 1e9:.2f} GB of weights, the KV cache holds {kv_tokens:,} tokens, "
                  f"less than one {req.context_tokens:,}-token context")
    elif max_batch < 1:
        reason = f"the KV cache ({kv_tokens:,} tokens) holds no sequence of {seq_tokens:,} tokens"
    mid = req.prompt_tokens + req.output_tokens / 2          # mean attended context while decoding
    ttft = step_s(shape, hosts, req, tp, pp, replicas, req.prompt_tokens, req.prompt_tokens / 2, seqs=1)[0]
    tpot1, tp_comm1, _ = step_s(shape, hosts, req, tp, pp, replicas, 1, mid)
    batch, limit = min(max_batch, req.max_batch), "kv memory" if max_batch <= req.max_batch else "max_batch"
    batch = max(batch, 1)
    bound = req.max_tpot_ms * 1e-3
    if bound and step_s(shape, hosts, req, tp, pp, replicas, batch, mid)[0] > bound:
        lo, hi = 1, batch                  # the step time grows with the batch: bisect the largest that meets it
        while lo < hi:
            m = (lo + hi + 1) // 2
            lo, hi = (m, hi) if step_s(shape, hosts, req, tp, pp, replicas, m, mid)[0] <= bound else (lo, m - 1)
        batch, limit = lo, "max_tpot"
    tpot, tp_comm, pp_comm = step_s(shape, hosts, req, tp, pp, replicas, batch, mid)
    # A batch of sequences lives for output_tokens steps and stalls for each member's prefill.
    per_replica = batch * req.output_tokens / (req.output_tokens * tpot + batch * ttft)
    return Placement(tp, pp, replicas, not reason, reason, weights, kv_per_token, kv_tokens, max_batch, batch,
                     limit, ttft, tpot1, tp_comm1, tpot, tp_comm, pp_comm, replicas * per_replica)


def _rank_key(req: ServingRequest) -> Callable[[Placement], tuple]:
    if req.target == "latency":
        return lambda p: (p.tpot_batch1_s, p.ttft_s, p.tp * p.pp, -p.tokens_per_s)
    return lambda p: (-p.tokens_per_s, p.tpot_s, p.tp * p.pp)


def plan(shape: ModelShape, hosts: HostSpec, req: ServingRequest, tp_options: tuple[int, ...] = (1, 2, 4, 8),
         pp_options: tuple[int, ...] = (1, 2, 4, 8, 16)) -> ServingPlan:
    """Every valid (tp, pp) with the most replicas that fit, the fitting ones ranked by the target.

    Fewer replicas than fit would only leave devices idle, which helps neither target. Raises
    ConfigError, naming the fields to change, when nothing fits.
    """
    cands = []
    for tp in sorted(set(tp_options)):
        if tp_invalid_reason(shape, hosts, tp):
            continue
        for pp in sorted(set(pp_options)):
            if pp <= shape.n_layers and tp * pp <= hosts.devices:
                cands.append(evaluate(shape, hosts, req, tp, pp))
    if not cands:
        raise ConfigError(f"search.tp {list(tp_options)} / search.pp {list(pp_options)}: no degree splits "
                          f"{shape.n_heads} heads / {shape.n_kv_heads} kv heads on {hosts.procs_per_host} "
                          f"processes per host within {hosts.devices} devices")
    fitting = [p for p in cands if p.fits]
    bound = req.max_tpot_ms * 1e-3
    meets = [p for p in fitting if not bound or (p.tpot_batch1_s if req.target == "latency" else p.tpot_s) <= bound]
    if not fitting:
        largest = max(cands, key=lambda p: (p.tp * p.pp, -p.weight_bytes_per_device))
        dtype = ", model.params_dtype / model.kv_dtype bf16" if max(req.param_bytes, req.kv_bytes) > 2 else ""
        raise ConfigError(f"nothing fits: at tp={largest.tp} pp={largest.pp} {largest.reason}; raise hosts.hosts "
                          f"or hosts.memory_gb{dtype}, or lower target.context")
    if not meets:
        best = min(p.tpot_batch1_s for p in fitting)
        raise ConfigError(f"target.max_tpot_ms {req.max_tpot_ms:g}: the fastest placement needs "
                          f"{best * 1e3:.2f} ms per token; raise it or add faster hosts")
    ranked = sorted(meets, key=_rank_key(req))
    return ServingPlan(ranked, [p for p in cands if not p.fits], explain(ranked, cands, hosts, req))


def format_bytes(nbytes: float) -> str:
    """GB with two decimals, or MB below 1 GB (small models on CPU)."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _name(p: Placement) -> str:
    return f"tp={p.tp}" + (f" pp={p.pp}" if p.pp > 1 else "") + (f" x{p.replicas}" if p.replicas > 1 else "")


def _compare(best: Placement, rival: Placement, hosts: HostSpec, latency: bool) -> str:
    """One line: why `best` beat `rival`, the runner-up with a different tensor-parallel degree."""
    link = f"a {hosts.intra_host_gb_per_s:g} GB/s, {hosts.intra_host_latency_us:g} us link"
    if latency:
        figures = f"{best.tpot_batch1_s * 1e3:.3f} vs {rival.tpot_batch1_s * 1e3:.3f} ms per token"
        if best.tp < rival.tp:
            cause = f"TP all-reduce adds {rival.tp_comm_batch1_s * 1e3:.3f} ms per token at tp={rival.tp} on {link}"
        else:
            cause = (f"each device reads 1/{best.tp} of the weights per token, for "
                     f"{best.tp_comm_batch1_s * 1e3:.3f} ms of all-reduce on {link}")
        return f"{_name(best)} beat {_name(rival)} on latency ({figures}): {cause}"
    figures = f"{best.tokens_per_s:,.0f} vs {rival.tokens_per_s:,.0f} tokens/s"
    lead = f"replicas={best.replicas}" if best.tp < rival.tp and best.replicas > rival.replicas else _name(best)
    if rival.batch_limit == "kv memory" and rival.batch < best.batch:
        cause = (f"at tp={rival.tp} the KV cache left beside the weights holds {rival.max_batch:,} sequences "
                 f"per replica, at tp={best.tp} {best.max_batch:,}")
    elif best.tp < rival.tp:
        cause = (f"{best.replicas * best.batch:,} sequences in flight vs {rival.replicas * rival.batch:,}, "
                 f"and TP all-reduce adds {rival.tp_comm_s * 1e3:.3f} ms per step at tp={rival.tp} on {link}")
    else:
        cause = (f"each device reads 1/{best.tp} of the weights per step, for {best.tp_comm_s * 1e3:.3f} ms of "
                 f"all-reduce on {link}")
    return f"{lead} beat {_name(rival)} on throughput ({figures}): {cause}"


def explain(ranked: list[Placement], cands: list[Placement], hosts: HostSpec, req: ServingRequest) -> list[str]:
    """Why the first placement wins: what forced its size, what it beat, where its time goes."""
    best, lines = ranked[0], []
    size = min(p.tp * p.pp for p in cands if p.fits)
    shorts = [p for p in cands if p.tp * p.pp < size]
    if shorts:
        short = max(shorts, key=lambda p: (p.tp * p.pp, p.tp))
        lines.append(f"tp*pp>={size} needed: at tp={short.tp} pp={short.pp} {short.reason}")
    if best.pp > 1:
        in_host = [p for p in cands if p.pp == 1]
        if not any(p.fits for p in in_host):
            lines.append(f"pp={best.pp} needed: the model and one context exceed one host's memory "
                         f"({hosts.procs_per_host} x {hosts.memory_gb:g} GB)")
        lines.append(f"pp={best.pp} buys memory, not speed: stages run one after another and add "
                     f"{best.pp_comm_s * 1e3:.3f} ms of sends per token")
    latency = req.target == "latency"
    others = [p for p in ranked[1:] if p.tp != best.tp]
    rival = next((p for p in others if p.pp == best.pp), others[0] if others else None)
    if rival is not None:
        lines.append(_compare(best, rival, hosts, latency))
    lines.append(f"per device: weights {format_bytes(best.weight_bytes_per_device)}, KV "
                 f"{best.kv_tokens_per_device:,} tokens ({best.kv_bytes_per_token_per_device / 1e3:.1f} kB/token), "
                 f"{best.max_batch:,} sequences of {req.prompt_tokens + req.output_tokens} tokens")
    lines.append(f"batch {best.batch} per replica, limited by {best.batch_limit}: TPOT {best.tpot_s * 1e3:.3f} ms "
                 f"(TP comm {best.tp_comm_s * 1e3:.3f}, PP comm {best.pp_comm_s * 1e3:.3f}), "
                 f"{best.tokens_per_s:,.0f} tokens/s over {best.replicas} replica(s)")
    return lines
