"""One measurement of the peer benchmark: one framework, one process/thread count, the reference workload.

    python benchmarks/peers/worker.py --peer {stalwart,torchtitan,nanogpt,hf} --procs N --threads T
                                      [--steps S --warmup W --dtype D --compile]

Prints one JSON line: tokens/s over the timed steps (all processes together), step time, FLOPs per token.

``--dtype bfloat16`` runs every peer in mixed precision, fp32 master weights and optimizer: Stalwart with
``training.dtype = "bfloat16"``, the others' forward and loss under ``torch.autocast("cpu", torch.bfloat16)``
(what HF's Trainer does with ``bf16=True``; nanoGPT's train.py autocasts on GPU only, so this is the same
mechanism applied to its model).

The reference workload, the same in every peer: 4 layers, dim 256, 4 heads, seq 256, micro-batch 8 per
process, vocab 256, fp32, AdamW (lr 1e-3, weight decay 0.1), gradient clipping at 1.0, random byte tokens.
``--compile`` compiles each peer the way it compiles itself: per transformer block (Stalwart's
``parallelism.compile``, torchtitan's ``apply_compile``; the same regional ``Module.compile`` on nanoGPT's
and transformers' blocks). The warm-up steps absorb the compilation; its time is reported as
``warmup_s``.

Each peer runs its own model code and its usual data-parallel wrapper:

- stalwart: Stalwart's training core (``TrainCore.train_step``, what `stalwart train` runs: the layout
  `parallelism.data_parallel = auto` picks, clipping, the gated optimizer), Llama block, SwiGLU hidden 768.
- torchtitan: torchtitan's own Llama 3 model (``Llama3Model`` built from its config classes at the reference
  shape, fused wqkv as in every torchtitan flavor, SwiGLU hidden 768, untied head, torchtitan's init), with
  its maskless SDPA inner attention (the causal kernel Stalwart runs; torchtitan's language-model default,
  flex attention, needs compile to be fast on CPU and masks per document), a plain loop, and for N > 1 its
  default data-parallel layout: FSDP2 ``fully_shard`` on every block and the root (``dp_shard = -1``).
- nanogpt: karpathy/nanoGPT's ``model.py`` (vendored, unchanged, ``nanogpt_model.py``) with its training
  script's settings (bias-free, no dropout, tied head), GPT-2 block (MLP 4 x dim, GELU), DDP for N > 1.
- hf: Hugging Face ``transformers`` ``LlamaForCausalLM`` (SDPA attention, SwiGLU hidden 768, untied
  head), a plain loop (forward, cross-entropy, backward, clip, AdamW) as HF's Trainer runs it, DDP for N > 1.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

DIM, LAYERS, HEADS, SEQ, VOCAB, HIDDEN, MICRO = 256, 4, 4, 256, 256, 768, 8

# The other workloads (``--workload``): the reference model at 4x the sequence (2 sequences of 1,024 per
# step, the reference's tokens per step; several processes split each sequence: context parallel), and
# Stalwart's ``debug-moe`` shape (dim 64, 4 layers, 4 heads / 2 kv heads, vocab 512, one dense SwiGLU
# layer of 192 then three of 8 experts of hidden 96, top-2, softmax router; several processes split the
# experts: expert parallel, each with its own micro-batch of 8 x 256).
WORKLOADS = {"reference": dict(seq=SEQ, micro=MICRO, vocab=VOCAB),
             "long": dict(seq=4 * SEQ, micro=2, vocab=VOCAB),
             "moe": dict(seq=SEQ, micro=MICRO, vocab=512)}
MOE = dict(dim=64, layers=4, heads=4, kv_heads=2, hidden=192, experts=8, top_k=2, expert_hidden=96, dense_layers=1)


def _tokens(seed: int, workload: str = "reference", n: int = 4) -> list[torch.Tensor]:
    w = WORKLOADS[workload]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, w["vocab"], (w["micro"], w["seq"] + 1), generator=gen) for _ in range(n)]


def _stalwart(rank: int, world: int, dtype: str, compiled: bool, workload: str = "reference"):
    from dataclasses import replace

    from stalwart.bench.throughput import reference_args
    from stalwart.config.job import (CommConfig, OptimizerConfig, ParallelismConfig, SchedulerConfig,
                                     TrainingConfig)
    from stalwart.data.loader import Batch
    from stalwart.models.flavors import FLAVORS
    from stalwart.runtime import HOST, DistEnv
    from stalwart.train.core import CoreSpec, TrainCore

    w = WORKLOADS[workload]
    if workload == "moe":  # the experts split over the processes (expert parallel), each its own batch
        args, parallelism, dp = FLAVORS["debug-moe"], ParallelismConfig(compile=compiled, ep=world), world
    elif workload == "long":  # every sequence split over the processes (context parallel)
        args, parallelism, dp = (replace(reference_args(), max_seq_len=w["seq"]),
                                 ParallelismConfig(compile=compiled, cp=world), 1)
    else:
        args, parallelism, dp = reference_args(), ParallelismConfig(compile=compiled), world
    spec = CoreSpec(args, parallelism, CommConfig(), OptimizerConfig(lr=1e-3),
                    SchedulerConfig(kind="constant", warmup_steps=0),
                    TrainingConfig(steps=10**6, global_batch=w["micro"] * dp, micro_batch=w["micro"], dtype=dtype,
                                   device="cpu"), w["seq"], accum_steps=1)
    core = TrainCore.build(spec, DistEnv(rank, world, rank, world, HOST))
    batches = [[Batch(b[:, :-1], b[:, 1:])] for b in _tokens(rank if dp > 1 else 0, workload)]
    return (lambda i: core.train_step(batches[i % len(batches)])), core.flops_per_token, w["micro"] * w["seq"] * dp


def _compile_blocks(blocks, compiled: bool, fullgraph: bool = False) -> None:
    """Regional compilation: each transformer block compiled in place."""
    if compiled:
        for block in blocks:
            block.compile(fullgraph=fullgraph)


def _plain_loop(model: torch.nn.Module, world: int, loss_of, rank: int, dtype: str, wrap: bool = True,
                workload: str = "reference", context=None):
    """forward -> loss -> backward -> clip -> AdamW, DDP-wrapped with more than one process (unless the
    peer wrapped the model itself: ``wrap`` False); forward and loss under bf16 autocast when ``dtype`` is
    bfloat16."""
    import contextlib

    if world > 1 and wrap:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = _tokens(rank, workload)

    def step(i: int) -> None:
        b = data[i % len(data)]
        with (torch.autocast("cpu", torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()), \
                (context() if context else contextlib.nullcontext()):
            loss = loss_of(model, b[:, :-1].contiguous(), b[:, 1:].contiguous())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _titan_inits():
    from functools import partial

    from torchtitan.models.common.param_init import depth_scaled_std

    linear = {"weight": partial(torch.nn.init.trunc_normal_, std=0.02), "bias": torch.nn.init.zeros_}

    def depth(layer: int) -> dict:
        return {"weight": partial(torch.nn.init.trunc_normal_, std=depth_scaled_std(0.02, layer)),
                "bias": torch.nn.init.zeros_}

    return linear, {"weight": torch.nn.init.ones_}, depth, {"weight": partial(torch.nn.init.normal_, std=1.0)}


def _titan_llama(seq: int):
    """torchtitan's Llama 3 at the reference shape (``seq``: the RoPE table's length)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    linear, norm, depth, embed = _titan_inits()
    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=seq, theta=10000.0)
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
        ffn_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
        attention=make_gqa_config(dim=DIM, n_heads=HEADS, n_kv_heads=HEADS, wqkv_param_init=linear,
                                  wo_param_init=depth(i), inner_attention=ScaledDotProductAttention.Config(),
                                  fuse_qkv=True, rope=rope),
        feed_forward=make_ffn_config(dim=DIM, hidden_dim=HIDDEN, w1_param_init=linear, w2w3_param_init=depth(i)),
    ) for i in range(LAYERS)]
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=embed),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=linear),
        layers=layers)


def _titan_moe(ep: int):
    """torchtitan's MoE decoder (its Qwen3 block: GQA attention without the QK norm, its MoE module: token-choice
    top-k softmax router, grouped experts, no load-balancing bias) at the ``debug-moe`` shape."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (make_ffn_config, make_gqa_config, make_moe_config,
                                                        make_routed_experts_config, make_router_config)
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    linear, norm, depth, embed = _titan_inits()
    m, vocab = MOE, WORKLOADS["moe"]["vocab"]
    rope = ComplexRoPE.Config(dim=m["dim"] // m["heads"], max_seq_len=WORKLOADS["moe"]["seq"], theta=10000.0)
    experts = {"w1_EFD": linear["weight"], "w2_EDF": depth(0)["weight"], "w3_EFD": linear["weight"]}
    layers = []
    for i in range(m["layers"]):
        ffn = {"feed_forward": make_ffn_config(dim=m["dim"], hidden_dim=m["hidden"], w1_param_init=linear,
                                               w2w3_param_init=depth(i))} if i < m["dense_layers"] else {
            "moe": make_moe_config(num_experts=m["experts"], load_balance_coeff=None,
                                   router=make_router_config(dim=m["dim"], num_experts=m["experts"], top_k=m["top_k"],
                                                             gate_param_init=linear, score_func="softmax",
                                                             route_norm=True),
                                   routed_experts=make_routed_experts_config(
                                       dim=m["dim"], hidden_dim=m["expert_hidden"], num_experts=m["experts"],
                                       top_k=m["top_k"], param_init=experts, comm_backend="standard"))}
        layers.append(Qwen3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=m["dim"], param_init=norm),
            ffn_norm=RMSNorm.Config(normalized_shape=m["dim"], param_init=norm),
            attention=make_gqa_config(dim=m["dim"], n_heads=m["heads"], n_kv_heads=m["kv_heads"],
                                      wqkv_param_init=linear, wo_param_init=depth(i), fuse_qkv=True, rope=rope,
                                      inner_attention=ScaledDotProductAttention.Config()), **ffn))
    cfg = Qwen3Model.Config(
        dim=m["dim"], vocab_size=vocab, norm=RMSNorm.Config(normalized_shape=m["dim"], param_init=norm),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=m["dim"], param_init=embed),
        lm_head=Linear.Config(in_features=m["dim"], out_features=vocab, param_init=linear), layers=layers)
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=ep > 1)
    return cfg


def _titan_parallelize(model, world: int, cp: int = 1, ep: int = 1):
    """torchtitan's own parallelize function for the model (as its trainer calls it, legacy DTensor backend),
    on a CPU mesh (torchtitan's device type is CUDA where there is none). Returns the context each step runs
    in."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as titan_utils

    titan_dims.device_type = "cpu"
    titan_utils.set_spmd_backend("partial_dtensor")
    dims = titan_dims.ParallelDims(dp_replicate=1, dp_shard=world // cp // ep * ep if ep > 1 else world // cp,
                                   cp=cp, tp=1, pp=1, ep=ep, world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    if ep > 1:
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3 as parallelize
    else:
        from torchtitan.models.llama3.parallelize import parallelize_llama as parallelize
    parallelize(model, parallel_dims=dims, training=TrainingConfig(), compile_config=CompileConfig(),
                parallelism=ParallelismConfig(context_parallel_degree=cp, expert_parallel_degree=ep,
                                              spmd_backend="partial_dtensor"), ac_config=None, dump_folder="/tmp")
    return titan_utils.get_spmd_context(parallel_dims=dims)


def _torchtitan(rank: int, world: int, dtype: str, compiled: bool, workload: str = "reference"):
    torch.manual_seed(0)
    w = WORKLOADS[workload]
    model = (_titan_moe(world) if workload == "moe" else _titan_llama(w["seq"])).build()
    model.init_states()
    n = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    dim, layers = (MOE["dim"], MOE["layers"]) if workload == "moe" else (DIM, LAYERS)
    if workload == "moe":  # the active parameters: top-k of the routed experts
        routed = sum(p.numel() for name, p in model.named_parameters() if "inner_experts" in name)
        n -= routed * (MOE["experts"] - MOE["top_k"]) // MOE["experts"]
    flops = 6 * n + 12 * layers * dim * w["seq"]
    _compile_blocks(model.layers.values(), compiled, fullgraph=True)
    context, dp = None, world
    if world > 1 and workload == "reference":  # FSDP2 on every block and the root, torchtitan's default layout
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    elif world > 1:  # expert or context parallel through torchtitan's own parallelize function
        context = _titan_parallelize(model, world, cp=world if workload == "long" else 1,
                                     ep=world if workload == "moe" else 1)
        dp = 1 if workload == "long" else world

    def loss_of(m, x, y):
        return F.cross_entropy(m(x).flatten(0, 1).float(), y.flatten())

    step = _plain_loop(model, world, loss_of, rank if dp > 1 else 0, dtype, wrap=False, workload=workload,
                       context=context)
    return step, flops, w["micro"] * w["seq"] * dp


def _nanogpt(rank: int, world: int, dtype: str, compiled: bool, workload: str = "reference"):
    _reference_only("nanogpt", workload)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from nanogpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS, n_embd=DIM,
                          dropout=0.0, bias=False))
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    flops = 6 * n + 12 * LAYERS * DIM * SEQ  # the same convention as Stalwart's flops_per_token
    _compile_blocks(model.transformer.h, compiled)
    return _plain_loop(model, world, lambda m, x, y: m(x, y)[1], rank, dtype), flops, MICRO * SEQ * world


def _hf(rank: int, world: int, dtype: str, compiled: bool, workload: str = "reference"):
    _reference_only("hf", workload)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                      tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(cfg).float()
    n = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    flops = 6 * n + 12 * LAYERS * DIM * SEQ
    _compile_blocks(model.model.layers, compiled)

    def loss_of(m, x, y):
        logits = m(input_ids=x).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return _plain_loop(model, world, loss_of, rank, dtype), flops, MICRO * SEQ * world


def _reference_only(peer: str, workload: str) -> None:
    if workload != "reference":
        raise SystemExit(f"{peer} has no mixture of experts or context parallelism: --workload reference only")


PEERS = {"stalwart": _stalwart, "torchtitan": _torchtitan, "nanogpt": _nanogpt, "hf": _hf}


def _run(rank: int, world: int, port: int, opts: dict, out: str) -> None:
    torch.set_num_threads(opts["threads"])
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    step, flops, tokens_per_step = PEERS[opts["peer"]](rank, world, opts["dtype"], opts["compile"], opts["workload"])
    start = time.perf_counter()
    for i in range(opts["warmup"]):
        step(i)
    if world > 1:
        dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(opts["steps"]):
        step(i)
    cpu = torch.tensor([time.process_time() - c0])  # this process's CPU seconds (all its threads)
    if world > 1:
        dist.barrier()
        dist.all_reduce(cpu)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        tokens = opts["steps"] * tokens_per_step
        with open(out, "w") as fh:
            json.dump({"peer": opts["peer"], "procs": world, "threads": opts["threads"], "dtype": opts["dtype"],
                       "compile": opts["compile"], "workload": opts["workload"], "tokens_per_s": tokens / elapsed,
                       "step_s": elapsed / opts["steps"],
                       "cpu_s_per_step": cpu.item() / opts["steps"], "warmup_s": t0 - start, "flops_per_token": flops,
                       "tflops": tokens / elapsed * flops / 1e12}, fh)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", choices=sorted(PEERS), required=True)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="threads per process")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--compile", action="store_true", help="compile each transformer block (regional)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="reference",
                   help="reference; long: 4x the sequence, context parallel over the processes; moe: debug-moe, "
                        "expert parallel over the processes (Stalwart and torchtitan only)")
    a = p.parse_args(argv)
    import tempfile

    opts = {"peer": a.peer, "threads": a.threads, "steps": a.steps, "warmup": a.warmup, "dtype": a.dtype,
            "compile": a.compile, "workload": a.workload}
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        if a.procs == 1:
            _run(0, 1, 0, opts, out)
        else:
            import torch.multiprocessing as mp

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(_run, args=(a.procs, port, opts, out), nprocs=a.procs, join=True, start_method="spawn")
        with open(out) as fh:
            print(json.dumps(json.load(fh)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
