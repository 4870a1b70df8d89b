"""The reusable training core: one model under one parallel layout, its optimizer and schedule, and
``train_step`` on batches the caller supplies with a loss the caller may supply.

The pre-training loop (``stalwart.train.trainer``) is one user; an RL trainer or a single controller
is another: they build a :class:`TrainCore`, feed it their own batches and loss function, and save or
restore it through the same :class:`~stalwart.train.checkpointer.Checkpointer`::

    core = TrainCore.build(spec, env)
    record = core.train_step(batches)                  # next-token cross-entropy
    record = core.train_step(batches, loss_fn=my_loss)  # loss_fn(logits, targets) -> scalar

``train_step`` is data -> forward/backward -> clip -> optimizer step -> zero grad. Whether a step's
update is applied is decided by the optimizer wrapper (:class:`~stalwart.train.optim.GatedOptimizer`):
fault tolerance registers its gate there, and nothing in the step names it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from stalwart.data.loader import Batch
from stalwart.models.llama import Transformer, TransformerArgs, count_params, flops_per_token
from stalwart.parallel.apply import parallelize
from stalwart.parallel.dims import ParallelDims, build_mesh, virtual_stages
from stalwart.parallel.elastic import (TreeAccumulator, apply_tree_reduce_scatter, check_elastic_layout,
                                       tree_grad_norm)
from stalwart.parallel.replicate import start_replicas
from stalwart.runtime.device import is_accelerator
from stalwart.runtime.env import DistEnv
from stalwart.train.compile_choice import resolve_compile, use_compile_cache
from stalwart.train.dist_env import replica_fits_here
from stalwart.train.experts import ExpertBalancer
from stalwart.train.init import materialize_and_init
from stalwart.train.optim import GatedOptimizer, LRSchedule, build_optimizer, clip_grad_norm
from stalwart.train.contrastive import contrastive_loss
from stalwart.train.step import LossFn, StepRunner

# A function run after backward and before clipping: (step, this rank's loss) -> the loss to report.
BackwardHook = Callable[[int, "torch.Tensor | None"], "torch.Tensor | None"]


@dataclass
class TrainState:
    """The counters of training: optimizer steps taken and tokens consumed."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


@dataclass
class CoreSpec:
    """What a core is built from: the config sections it needs, never the root config."""

    model_args: TransformerArgs
    parallelism: object        # ParallelismConfig
    comm: object               # CommConfig
    optimizer: object          # OptimizerConfig
    scheduler: object          # SchedulerConfig
    training: object           # TrainingConfig
    seq_len: int
    accum_steps: int           # micro-batches per optimizer step on this rank
    seed: int = 0
    deterministic: bool = True
    # The resolved compute dtype (``training.dtype = auto`` resolved from the measured peaks); None:
    # bfloat16 when configured, or auto on a GPU, float32 otherwise.
    compute_dtype: torch.dtype | None = None
    # The machine's cache folder setting (``data.cache``; '' = $STALWART_CACHE or ~/.cache/stalwart):
    # compiled blocks are kept under its ``compile/`` (train/compile_choice.py).
    cache_dir: str = ""

    @property
    def flops_per_token(self) -> float:
        # a contrastive step's rows are half a sequence each (a pair's query or document)
        pairs = getattr(self.training, "objective", "lm") == "contrastive"
        return flops_per_token(self.model_args, self.seq_len // 2 if pairs else self.seq_len)

    @property
    def tokens_per_step(self) -> int:
        return self.training.global_batch * self.seq_len

    def param_dtype(self, device: torch.device) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        if self.training.dtype == "bfloat16" or (self.training.dtype == "auto" and is_accelerator(device)):
            return torch.bfloat16
        return torch.float32


class TrainCore:
    """Model + layout + optimizer + schedule of one rank, and the step that trains them."""

    def __init__(self, spec: CoreSpec, env: DistEnv, dims: ParallelDims, timer=None) -> None:
        self.spec, self.env, self.dims = spec, env, dims
        self.device = env.device
        self.param_dtype = spec.param_dtype(self.device)
        if spec.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(spec.seed)
        a = spec.model_args
        dims.check_model(a.n_heads, a.n_kv_heads, a.n_layers, spec.seq_len, virtual_stages(spec.parallelism, dims),
                         a.moe.n_experts if a.moe else 0)
        self.mesh = build_mesh(dims, self.device) if env.is_distributed else None
        # parallelism.compile = auto | true | false, resolved (measured and cached per machine) before building.
        if spec.parallelism.compile is not False:
            use_compile_cache(spec.cache_dir)
        self.compiled, self.compile_reason = resolve_compile(spec.parallelism.compile, spec, dims, self.param_dtype,
                                                             env)
        # Build on meta, parallelize, then materialize and initialise from the seed: every layout starts
        # from the same bits.
        with torch.device("meta"):
            model = Transformer(a)
        elastic = bool(getattr(spec.training, "elastic_exact", False))
        if elastic:
            check_elastic_layout(dims, spec.optimizer.name)
        self.pm = parallelize(model, dims, self.mesh, replace(spec.parallelism, compile=self.compiled),
                              self.param_dtype, spec.comm, env.rank,
                              elastic=elastic)
        self.model = self.pm.container  # every parameter this rank owns, under its original name
        materialize_and_init(self.model, self.device, spec.seed, stages=self.pm.stages)
        if self.pm.replicated:
            start_replicas(self.pm.stages)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(spec.optimizer, self.model, elementwise=elastic)
        self.opt = GatedOptimizer(self.optimizer)
        self.schedule = LRSchedule(spec.scheduler, spec.optimizer.lr, spec.training.steps)
        self.runner = StepRunner(self.pm, dims, self.mesh, self.device, env.rank, spec.accum_steps,
                                 spec.parallelism.pp_schedule, timer)
        self.timer = self.runner.timer
        if getattr(spec.training, "objective", "lm") == "contrastive":  # an embeddings model (train/contrastive.py)
            self.runner.objective = contrastive_loss(spec.training.temperature)
        self.elastic_norm = None  # the layout-independent gradient norm under training.elastic_exact
        if elastic:
            leaves = spec.training.global_batch // spec.training.micro_batch
            dp_group = self.mesh.dp.get_group() if dims.dp > 1 else None
            last, shard_group = None, None
            if dims.dp_shard > 1:
                shard_group = self.mesh.fsdp.get_group(self.mesh.fsdp.ndim - 1)
                last = apply_tree_reduce_scatter(self.pm.stages, leaves, dims.dp_rank(env.rank), dims.dp,
                                                 dims.dp_shard, dp_group)
            self.runner.use_elastic(TreeAccumulator(leaves, dims.dp_rank(env.rank), dims.dp), dp_group,
                                    self.params, last)
            self.elastic_norm = lambda: tree_grad_norm(self.params, shard_group, dims.dp_shard)
        self.pp_group = self.mesh["pp"].get_group() if dims.pp > 1 else None
        self.state = TrainState()
        self.backward_hooks: list[BackwardHook] = []
        self.flops_per_token, self.tokens_per_step = spec.flops_per_token, spec.tokens_per_step
        self.experts = (ExpertBalancer(self.pm.stages, a, dims, self.device, env.is_distributed, self.pm.expert_comm)
                        if ExpertBalancer.wanted(a) else None)

    @classmethod
    def build(cls, spec: CoreSpec, env: DistEnv, timer=None) -> "TrainCore":
        fits = replica_fits_here(env, count_params(spec.model_args))
        return cls(spec, env, ParallelDims.resolve(spec.parallelism, env.world_size, fits), timer)

    # ------------------------------------------------------------------ the step
    def train_step(self, micro: list[Batch], loss_fn: LossFn | None = None) -> dict:
        """One optimizer step on this rank's micro-batches. Returns the step's record (loss averaged
        over the ranks that computed one, learning rate, gradient norm, whether it was applied)."""
        t0 = time.perf_counter()
        step = self.state.step + 1
        lr = self.schedule.apply(self.optimizer)
        local_loss = self.runner.forward_backward(micro, loss_fn)
        for hook in self.backward_hooks:
            local_loss = hook(step, local_loss)
        compute_s = time.perf_counter() - t0
        with self.timer.phase("optimizer"):
            grad_norm = clip_grad_norm(self.params, self.spec.training.grad_clip, self.pp_group,
                                       self.elastic_norm() if self.elastic_norm is not None else None)
            decision = self.opt.step(step, local_loss, grad_norm, compute_s)
            self.opt.zero_grad()
        self.schedule.advance()
        self.state.step = step
        self.state.tokens_seen += self.tokens_per_step
        loss = decision.mean_loss if decision.mean_loss is not None else self.mean_over_ranks(local_loss)
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_seen": self.state.tokens_seen}
        if self.experts is not None:
            record.update(self.experts.after_step(decision.commit))
        if not decision.commit:
            record["skipped"] = True
        return record

    def mean_over_ranks(self, local: torch.Tensor | None) -> float:
        """Average of the ranks that computed a loss (pipeline ranks without the last stage did not)."""
        pair = torch.zeros(2, dtype=torch.float64, device=self.device)
        if local is not None:
            pair[0], pair[1] = float(local), 1.0
        if self.env.is_distributed:
            dist.all_reduce(pair)
        return float(pair[0] / pair[1])

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> float:
        """Mean token loss over the ranks' shares of ``batches`` (collective)."""
        loss_sum, count = self.runner.evaluate(batches)
        total = torch.tensor([loss_sum, count], dtype=torch.float64, device=self.device)
        if self.env.is_distributed:
            dist.all_reduce(total)
        return float(total[0] / total[1])

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's local shards of parameters, gradients and optimizer state."""
        def local_bytes(t: torch.Tensor) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        params = sum(local_bytes(p) for p in self.params)
        grads = params  # every trainable parameter's gradient has its shard's shape (freed between steps)
        optim = sum(local_bytes(v) for st in self.optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"param_bytes": params, "grad_bytes": grads, "optim_bytes": optim}
