"""Whether a run compiles its blocks: ``parallelism.compile = auto | true | false``.

Compilation is regional (``parallel/activation_checkpoint.apply_compile``): each transformer block is
``torch.compile``d in place, and because every block runs the same code on parameters of the same
shapes, Dynamo traces it once and every block reuses the one compiled graph. Start-up is one block's
compile, whatever the depth: its training graph (forward and backward) and, since evaluation runs
without gradients, a second forward graph (Dynamo recompiles on the change of grad mode).

Inductor keeps what it compiled (FX graphs, AOT autograd graphs, the C++/Triton kernels) on disk under
``<cache>/compile`` (the machine's Stalwart cache: ``data.cache``, ``$STALWART_CACHE``,
``$XDG_CACHE_HOME/stalwart`` or ``~/.cache/stalwart``; ``$TORCHINDUCTOR_CACHE_DIR`` wins when set), so
only the first run of a shape pays the full compile; later runs load it.

``auto`` decides the way ``training.dtype = auto`` does, from a measurement cached per machine in the
same file as the matmul peaks (``metrics/mfu.py: PeakCache``): one block of the run's shape, in the
run's precision (cast per unit as it runs where no FSDP casts: ``parallel/precision.py``) and
activation checkpointing, timed forward + backward eager and compiled, and the compiled block's
start-up: with the cache cold (or as it was) in this process, and, what every start and restart of a
compiled run pays, in a new process with the cache warm (``new_process_start_s``: ``torch.compile``,
an evaluation's forward and a training step's forward and backward, beyond the same calls eager).
A second compile in the measuring process would not show that figure: Dynamo's and Inductor's set-up
and the loaded graphs stay in the process, so it took 0.24 s where a new process took 3.1 s and a
2-process ``debug`` run's first step 7.5-9.2 s (docs/parallelism.md). It compiles when the block is at
least ``AUTO_COMPILE_MIN_SPEEDUP`` faster and the time saved over the run's steps exceeds that
start-up. A run whose blocks take less than ``MEASURE_MIN_S`` eager in all is decided from the eager
timing alone, without compiling anything: the measurement's own first compile (30-270 s on a loaded
2-core CPU) would cost more than such a run could save, and tiny runs and the test suite stay eager
at no cost. Layouts that split the block across ranks (tp, cp, ep, pp)
run eager under ``auto`` (the block cannot be timed alone); ``true`` compiles them anyway. Rank 0
decides, every rank runs what it decided.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from stalwart.data.cache import cache_root
from stalwart.metrics.mfu import PeakCache, cache_key
from stalwart.models.flavors import MoEArgs, TransformerArgs
from stalwart.models.llama import TransformerBlock, rope_tables
from stalwart.parallel.activation_checkpoint import apply_activation_checkpointing, apply_compile
from stalwart.parallel.dims import replicates_whole_model
from stalwart.parallel.precision import apply_cast
from stalwart.runtime.device import is_accelerator, synchronize

# `compile = auto` compiles only where a compiled block is at least this much faster than eager: below
# it, the measurement's noise could decide, and a compiled run is harder to debug.
AUTO_COMPILE_MIN_SPEEDUP = 1.05
# NOTE: below this many seconds of eager block compute in the whole run, `auto` does not measure a
# compiled block: that measurement compiles one (30-270 s cold on a loaded 2-core CPU, once per machine
# and shape) and even a 1.3x faster block would save a run this short less than that.
MEASURE_MIN_S = 60.0
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
PROBE_TIMEOUT_S = 240.0  # the other ranks wait meanwhile, within fault.collective_timeout_s (300 s)


@dataclass(frozen=True)
class BlockTimes:
    """One block's forward + backward (seconds) eager and compiled, and the compiled block's start-up:
    its first calls with the cache as it was (``first_s``) and again after a reset (``warm_s``), both in
    the measuring process, and in a new process with the cache warm (``start_s``, 0 = not measured)."""

    eager_s: float
    compiled_s: float = 0.0
    first_s: float = 0.0
    warm_s: float = 0.0
    start_s: float = 0.0

    @property
    def startup_s(self) -> float:
        """What compiling adds to each start and restart of a run, the cache warm."""
        return max(self.warm_s, self.start_s)


def use_compile_cache(setting: str = "") -> Path:
    """Point Inductor's on-disk caches at ``<cache>/compile`` (unless ``$TORCHINDUCTOR_CACHE_DIR`` is
    set); worker processes inherit it."""
    if not os.environ.get(INDUCTOR_CACHE_ENV):
        os.environ[INDUCTOR_CACHE_ENV] = str(cache_root(setting) / "compile")
    return Path(os.environ[INDUCTOR_CACHE_ENV])


def choose_compile(t: BlockTimes, blocks_per_step: int, steps: int) -> tuple[bool, str]:
    """Whether ``compile = auto`` compiles, from one block's timings, the blocks a step runs on this
    rank and the run's steps, and why (pure)."""
    eager_run = t.eager_s * blocks_per_step * steps
    if not t.compiled_s:
        return False, (f"eager (auto: the run's blocks take ~{eager_run:.1f} s eager over {steps} steps, under "
                       f"the {MEASURE_MIN_S:.0f} s it takes for a compile to pay)")
    ratio = t.eager_s / t.compiled_s
    saved = (t.eager_s - t.compiled_s) * blocks_per_step * steps
    measured = (f"a block's forward+backward {1e3 * t.eager_s:.1f} ms eager, {1e3 * t.compiled_s:.1f} ms "
                f"compiled ({ratio:.2f}x); start-up {t.startup_s:.1f} s per start, cached, {t.first_s:.1f} s first")
    if ratio < AUTO_COMPILE_MIN_SPEEDUP:
        return False, f"eager (auto: {measured}; compiling needs >= {AUTO_COMPILE_MIN_SPEEDUP}x)"
    if saved <= t.startup_s:
        return False, f"eager (auto: {measured}; {saved:.1f} s saved over {steps} steps does not repay it)"
    return True, f"compiled (auto: {measured}; ~{saved:.0f} s saved over {steps} steps)"


def _best_times(runs, budget_s: float, least: int = 3) -> list[float]:
    """Each of ``runs``' best time, calling them in turn (so a change of load hits all alike) for at
    least ``least`` rounds and about ``budget_s`` seconds."""
    best, deadline, n = [float("inf")] * len(runs), time.perf_counter() + budget_s, 0
    while n < least or time.perf_counter() < deadline:
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - t0)
        n += 1
    return best


def _holder(args, dtype: torch.dtype, checkpointing: str, cast: bool, device: torch.device) -> nn.Module:
    """Block 0 of ``args`` as the run builds it, alone in a model-shaped holder: parameters in ``dtype``,
    or in float32 cast to ``dtype`` as it runs (``cast``), then activation checkpointing."""
    block = TransformerBlock(args, 0).to(device=device, dtype=torch.float32 if cast else dtype)
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": block})
    if cast:
        apply_cast(holder, dtype)
    apply_activation_checkpointing(holder, checkpointing)
    return holder


def _calls(holder: nn.Module, x: torch.Tensor, grad: torch.Tensor, rope, device: torch.device, evaluate: bool):
    """A training step's forward + backward of the block (after an evaluation's forward, ``evaluate``)."""
    def run() -> None:
        if evaluate:
            with torch.no_grad():
                holder.layers["0"](x, rope, None)
        holder.layers["0"](x, rope, None).backward(grad)
        synchronize(device)
    return run


def measure_block(args, micro_batch: int, seq_len: int, dtype: torch.dtype, checkpointing: str,
                  device: torch.device, compiled: bool, cast: bool = False) -> BlockTimes:
    """Time one freshly built block of ``args`` (layer 0) on a (micro_batch, seq_len, dim) input,
    eager and, with ``compiled``, compiled too (its start-up cold-or-as-cached, then warm after a reset,
    then in a new process; then both forms alternately). The global RNG is left as it was: the run's
    own init and data do not see this."""
    with torch.random.fork_rng(devices=[device] if is_accelerator(device) else []):
        torch.manual_seed(0)
        holders = [_holder(args, dtype, checkpointing, cast, device)]
        if compiled:  # one to compile, with the same weights
            holders.append(copy.deepcopy(holders[0]))
        x = torch.randn(micro_batch, seq_len, args.dim, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        rope = rope_tables(args.head_dim, seq_len, args.rope_theta, device=device)
        eager = _calls(holders[0], x, grad, rope, device, False)
        eager()
        if not compiled:
            return BlockTimes(*_best_times([eager], 0.3))
        first_warm = []
        for _ in range(2):
            torch._dynamo.reset()  # the second round loads from the on-disk caches the first filled
            apply_compile(holders[1])
            t0 = time.perf_counter()
            _calls(holders[1], x, grad, rope, device, True)()  # both graphs a run compiles
            first_warm.append(time.perf_counter() - t0)
        eager_s, compiled_s = _best_times([eager, _calls(holders[1], x, grad, rope, device, False)], 0.6)
        torch._dynamo.reset()
    start_s = new_process_start_s(args, micro_batch, seq_len, dtype, checkpointing, cast, device)
    return BlockTimes(eager_s, compiled_s, first_warm[0], first_warm[1], start_s)


# A worker is forked from a launcher that has imported torch's compiler stack (launch/fork.py: preload).
_PROBE = "import sys, torch._inductor; from stalwart.train.compile_choice import probe; probe(sys.argv[1])"


def new_process_start_s(args, micro_batch: int, seq_len: int, dtype: torch.dtype, checkpointing: str, cast: bool,
                        device: torch.device) -> float:
    """What compiling adds to the start of a new process with the compile cache warm (``probe``, run
    in a process of its own with the imports a worker has), in seconds; 0.0 where it could not be
    measured (then the in-process figure stands)."""
    spec = json.dumps({"args": asdict(args), "micro_batch": micro_batch, "seq_len": seq_len,
                       "dtype": str(dtype).removeprefix("torch."), "checkpointing": checkpointing, "cast": cast,
                       "device": str(device)})
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, spec], capture_output=True, text=True,
                             timeout=PROBE_TIMEOUT_S, env=os.environ.copy())
        return max(0.0, float(json.loads(out.stdout.strip().splitlines()[-1])["start_s"]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError, TypeError):
        return 0.0


def probe(spec: str) -> None:
    """In a new process (``new_process_start_s``): the block as the run builds it, an evaluation's
    forward and a training forward + backward eager (twice: the second is the baseline), then the same
    compiled, from ``torch.compile`` on; prints ``{"start_s": compiled seconds - eager seconds}``."""
    s = json.loads(spec)
    a = s["args"]
    args = TransformerArgs(**{**a, "moe": MoEArgs(**a["moe"]) if a.get("moe") else None})
    device, dtype = torch.device(s["device"]), getattr(torch, s["dtype"])
    torch.manual_seed(0)
    holder = _holder(args, dtype, s["checkpointing"], s["cast"], device)
    x = torch.randn(s["micro_batch"], s["seq_len"], args.dim, device=device, dtype=dtype, requires_grad=True)
    rope = rope_tables(args.head_dim, s["seq_len"], args.rope_theta, device=device)
    run = _calls(holder, x, torch.randn_like(x), rope, device, True)
    run()
    t0 = time.perf_counter()
    run()
    eager_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    apply_compile(holder)
    run()
    print(json.dumps({"start_s": time.perf_counter() - t0 - eager_s}), flush=True)


def _block_key(device: torch.device, dtype: torch.dtype, args, micro_batch: int, seq_len: int,
               checkpointing: str, cast: bool = False) -> str:
    moe = f"moe {args.moe.n_experts}x{args.moe.hidden}" if args.is_moe_layer(0) else f"ffn {args.ffn_hidden}"
    return (f"{cache_key(device, dtype)}|compile block dim {args.dim} heads {args.n_heads}/{args.n_kv_heads} "
            f"{moe}|{micro_batch}x{seq_len}|ac {checkpointing}{'|cast' if cast else ''}")


def block_times(args, micro_batch: int, seq_len: int, dtype: torch.dtype, checkpointing: str, device: torch.device,
                blocks_per_step: int, steps: int, cache: PeakCache | None = None, cast: bool = False) -> BlockTimes:
    """The block's timings from the cache, else measured now (compiled only if the run is long enough
    for a compile to pay) and cached. A compiled measurement cached before the new process's start-up
    was measured (no ``start_s``) is measured again: its start-up figure was far too low."""
    cache = cache if cache is not None else PeakCache()
    key = _block_key(device, dtype, args, micro_batch, seq_len, checkpointing, cast)
    known = cache.load()
    names = ("eager_s", "compiled_s", "first_s", "warm_s", "start_s")
    if all(f"{key}|{n}" in known for n in names):
        return BlockTimes(*(known[f"{key}|{n}"] for n in names))
    eager = known.get(f"{key}|eager_s") or measure_block(args, micro_batch, seq_len, dtype, checkpointing, device,
                                                          False, cast).eager_s
    if eager * blocks_per_step * steps < MEASURE_MIN_S:
        cache.store(f"{key}|eager_s", eager)
        return BlockTimes(eager)
    t = measure_block(args, micro_batch, seq_len, dtype, checkpointing, device, True, cast)
    for n in names:
        cache.store(f"{key}|{n}", getattr(t, n))
    return t


def resolve_compile(requested, spec, dims, dtype: torch.dtype, env) -> tuple[bool, str]:
    """(compile the blocks?, why) for ``parallelism.compile``; rank 0 measures and decides (alone, so
    the figure is not shared with other ranks' work), every rank gets its answer."""
    if requested is True or requested is False:
        return requested, "compiled (configured)" if requested else "eager (configured)"
    box: list = [None]
    if env.is_main:
        if dims.tp > 1 or dims.cp > 1 or dims.ep > 1 or dims.pp > 1:
            box[0] = (False, "eager (auto: a block split over tp/cp/ep/pp ranks is not timed; set "
                             "parallelism.compile = true to compile it)")
        else:
            a = spec.model_args
            blocks = a.n_layers * spec.accum_steps
            # Where no FSDP casts (parallel/apply.py: one process without a group, DDP's replicas, elastic
            # replicas), the blocks' float32 parameters are cast as they run.
            elastic = bool(getattr(spec.training, "elastic_exact", False))
            cast = dtype != torch.float32 and (not env.is_distributed or replicates_whole_model(dims) or (
                elastic and dims.dp_shard == 1))
            t = block_times(a, spec.training.micro_batch, spec.seq_len, dtype, spec.parallelism.activation_checkpoint,
                            env.device, blocks, spec.training.steps, cast=cast)
            box[0] = choose_compile(t, blocks, spec.training.steps)
    if env.is_distributed:
        dist.broadcast_object_list(box, src=0)
    return box[0]
