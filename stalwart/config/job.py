"""The training job's configuration tree: one section per component.

Each component receives only its own section (``build_optimizer(cfg.optimizer, ...)``,
``build_sinks(cfg.observe, ...)``), never the root. Every field's help text is what
``stalwart train --help`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stalwart.config.controller import ControllerConfig
from stalwart.config.core import ConfigError, option, section
from stalwart.config.fault import FaultConfig
from stalwart.config.islands import IslandsConfig, check_islands
from stalwart.config.profile import ProfileConfig


@dataclass
class RunConfig:
    name: str = option("Run name; the run directory defaults to runs/<name>.", "default")
    dir: str = option("Run directory (config, metrics, events, checkpoints). Empty: runs/<run.name>.", "")
    seed: int = option("Seed for weight init, data order and sampling: equal seeds give equal runs.", 0, min=0)
    deterministic: bool = option("Use deterministic algorithms (bit-identical resume on CPU).", True)


AUTO_RESTARTS = 3  # launch.max_restarts = -1 (the default) under the supervisor


@dataclass
class LaunchConfig:
    nproc_per_node: int = option(
        "Worker processes to launch on this machine (also --nproc-per-node). Ignored under torchrun, "
        "which decides the world itself.", 1, min=1)
    threads_per_proc: int = option(
        "Intra-op CPU threads per worker; 0 = OMP_NUM_THREADS if set, else cores / nproc_per_node (at least 1).",
        0, min=0)
    max_restarts: int = option("Times the supervisor (torch's elastic agent) restarts the worker group after a "
                               "crash or a hang, from the newest in-memory snapshot or checkpoint; a user error "
                               "(exit 2) is never restarted. When used up the job exits 75 (requeue is fine); "
                               "see fault.crash_loop_restarts for exit 76. -1 = auto: "
                               f"{AUTO_RESTARTS} whenever the supervisor runs (several processes, fault injection, "
                               "the multi-node agent); a single process runs in-process, unsupervised, unless "
                               "this is set above 0.", -1, min=-1)
    fork_workers: bool = option("Start supervised workers by forking the launcher, which imports the trainer "
                                "once, before the first start: every start and restart skips a fresh "
                                "interpreter's imports (seconds per worker). false = a new interpreter per "
                                "worker, as torchrun starts them.", True)

    def restarts(self) -> int:
        """The restart budget of a supervised launch (``max_restarts``, ``-1`` resolved)."""
        return AUTO_RESTARTS if self.max_restarts < 0 else self.max_restarts

    def threads(self, local_world: int) -> int:
        """Intra-op threads of one worker when ``local_world`` workers share this machine."""
        import os

        if self.threads_per_proc:
            return self.threads_per_proc
        env = os.environ.get("OMP_NUM_THREADS", "")
        if env.isdigit() and int(env) > 0:  # the user's (or the launcher's) setting wins over the default
            return int(env)
        return max(1, (os.cpu_count() or 1) // max(1, local_world))


@dataclass
class ModelConfig:
    flavor: str = option("Model shape preset: debug, tiny, small, 125M, llama3-1B, llama3-3B, llama3-8B, "
                         "llama3-70B, llama3-405B; sparse (mixture of experts): debug-moe, mixtral-8x7B, "
                         "deepseek-v3-like, qwen3-moe-30B-A3B-like (see stalwart/models/flavors.py).", "tiny")
    dim: int = option("Override the flavor's hidden size (0 = keep the flavor's).", 0, min=0)
    n_layers: int = option("Override the number of transformer blocks (0 = flavor's).", 0, min=0)
    n_heads: int = option("Override the number of attention heads (0 = flavor's).", 0, min=0)
    n_kv_heads: int = option("Override the number of key/value heads for grouped-query attention (0 = flavor's).",
                             0, min=0)
    ffn_hidden: int = option("Override the SwiGLU hidden size (0 = derived from the flavor).", 0, min=0)
    vocab_size: int = option("Vocabulary size; 0 = take it from the tokenizer (padded to a multiple of 64).",
                             0, min=0)
    max_seq_len: int = option("Longest sequence RoPE tables are built for; 0 = data.seq_len.", 0, min=0)
    rope_theta: float = option("RoPE base frequency; 0 = flavor's.", 0.0, min=0.0)
    tie_embeddings: Literal["auto", "true", "false"] = option(
        "Share the input embedding and output head weights ('auto' = flavor's choice).", "auto")
    parallel_block: bool = option(
        "MegaScale/GPT-J parallel block: attention and MLP read the same normed input and are summed "
        "(one fewer serial dependency per layer).", False)
    sliding_window: int = option("Sliding-window attention width in tokens (0 = full causal attention).", 0, min=0)
    init_std: float = option("Std-dev of the normal init of linear and embedding weights.", 0.02, min=0.0)
    embed_dim: int = option("An embeddings model: the output head gives this many numbers per position, pooled "
                            "into one unit vector per text (train with training.objective = contrastive); 0 = "
                            "a language model (the head gives the vocabulary's logits).", 0, min=0)
    moe_experts: int = option("Routed experts per sparse layer (0 = the flavor's; > 0 makes a dense flavor a "
                              "mixture of experts).", 0, min=0)
    moe_top_k: int = option("Experts each token is routed to (0 = the flavor's).", 0, min=0)
    moe_hidden: int = option("SwiGLU hidden size of one expert (0 = the flavor's).", 0, min=0)
    moe_shared: int = option("Shared experts every token also passes through (-1 = the flavor's).", -1, min=-1)
    moe_dense_layers: int = option("The first this many layers keep a dense feed-forward (-1 = the flavor's).",
                                   -1, min=-1)
    moe_score: Literal["auto", "softmax", "sigmoid"] = option(
        "Router score function ('auto' = the flavor's); the top-k weights are renormalised to sum to 1.", "auto")
    moe_aux_loss: float = option("Weight of the sequence-wise auxiliary balance loss (-1 = the flavor's, 0 = off).",
                                 -1.0, min=-1.0)
    moe_bias_rate: float = option("Auxiliary-loss-free balancing: after each step every expert's routing bias moves "
                                  "this much towards balance (sign of mean load minus its load; -1 = the "
                                  "flavor's, 0 = off).", -1.0, min=-1.0)
    moe_compute: Literal["grouped", "loop"] = option(
        "Expert computation: one grouped matmul over all experts, or a loop over the experts with tokens.",
        "grouped")


@dataclass
class DataConfig:
    path: str = option("Training data: a dataset made by `stalwart data prepare` (a directory with index.json), "
                       "or text: a file, a directory, a glob of .txt/.py/.md/.jsonl/.parquet files, or a Hugging "
                       "Face `datasets.save_to_disk` directory, tokenized once into the data cache (data.cache). "
                       "Empty = the bundled default corpus (this Python's standard library sources).", "")
    mix: str = option("Weights of the prepared dataset's sources, 'NAME:WEIGHT,NAME:WEIGHT' (normalised; a "
                      "source left out gets none). Each global batch holds each source's share to within one "
                      "sequence. Empty = every source by its token count.", "")
    verify: Literal["full", "size"] = option("Checks of a prepared dataset at start (on the first rank): "
                                             "'full' = every shard's sha256, 'size' = presence and sizes only.",
                                             "full")
    cache: str = option("Where text given as data.path is tokenized, once per machine, and shared by every run "
                        "of the same inputs, settings and tokenizer (<run>/data links to its entry). Empty = "
                        "$STALWART_CACHE, else $XDG_CACHE_HOME/stalwart, else ~/.cache/stalwart.", "")
    prefetch: int = option("Global batches built ahead of the step on a background thread (0 = build in "
                           "the step).", 2, min=0)
    format: Literal["auto", "text", "jsonl", "parquet"] = option(
        "How to read data.path; 'auto' picks by file extension.", "auto")
    text_field: str = option("Field holding the text in JSONL/Parquet records.", "text")
    decode_errors: Literal["auto", "strict", "replace"] = option(
        "Text that is not valid UTF-8: 'strict' refuses the file, naming it and the byte offset; 'replace' "
        "substitutes U+FFFD and warns once per file with the count of replaced bytes; 'auto' = strict for "
        "data.path, replace for the bundled corpus (a few stdlib test files use legacy encodings). Binary data "
        "files (.npy, .bin, .arrow, NUL bytes, ...) are always refused by name.", "auto")
    tokenizer: str = option("'bpe' = train a byte-level BPE on the corpus (cached as <run>/tokenizer.json), "
                            "'byte' = 256-symbol byte vocabulary, or a path to a tokenizer.json.", "bpe")
    vocab_size: int = option("Target vocabulary size when training a BPE tokenizer.", 4096, min=260)
    tokenizer_train_mb: float = option("Megabytes of training text used to train the BPE tokenizer.", 4.0,
                                       min=0.01)
    seq_len: int = option("Tokens per training sequence (documents are packed, no padding).", 256, min=8)
    val_fraction: float = option("Fraction of documents held out for evaluation.", 0.02, min=0.0, max=0.5)
    max_mb: float = option("Text (not a prepared dataset): use only the first files of data.path, in path "
                           "order, up to this many megabytes (at least one file), so a machine's first run "
                           "tokenizes less (the debug config: 4). 0 = every file.", 0.0, min=0.0)


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "lamb"] = option("Optimizer: AdamW, or LAMB (layer-wise trust ratio, MegaScale's "
                                            "choice for very large batches).", "adamw")
    lr: float = option("Peak learning rate.", 3e-3, min=0.0)
    beta1: float = option("First-moment decay.", 0.9, min=0.0, max=1.0)
    beta2: float = option("Second-moment decay.", 0.95, min=0.0, max=1.0)
    eps: float = option("Denominator epsilon.", 1e-8, min=0.0)
    weight_decay: float = option("Decoupled weight decay (not applied to norms).", 0.1, min=0.0)
    fused: bool = option("Use the fused/foreach kernels where available (same math, faster).", True)


@dataclass
class SchedulerConfig:
    kind: Literal["cosine", "wsd", "constant"] = option(
        "Learning-rate schedule after warmup: cosine decay, warmup-stable-decay (WSD), or constant.", "cosine")
    warmup_steps: int = option("Linear warmup steps from 0 to the peak learning rate (clamped to training.steps, "
                               "with a note, for a shorter run).", 20, min=0)
    min_lr_ratio: float = option("Final learning rate as a fraction of the peak.", 0.1, min=0.0, max=1.0)
    decay_fraction: float = option("WSD only: fraction of training spent in the final decay.", 0.2,
                                   min=0.0, max=1.0)


@dataclass
class TrainingConfig:
    steps: int = option("Total optimizer steps; the schedule is defined over this many.", 200, min=1)
    stop_at_step: int = option("Save a checkpoint and exit cleanly at this step (0 = run to training.steps); "
                               "the schedule still follows training.steps. For time limits and preemption.",
                               0, min=0)
    global_batch: int = option("Sequences per optimizer step across all data-parallel ranks.", 8, min=1)
    micro_batch: int = option("Sequences per forward/backward on one rank; gradient accumulation makes up "
                              "the rest of the global batch.", 8, min=1)
    grad_clip: float = option("Clip the global gradient norm to this (0 = no clipping).", 1.0, min=0.0)
    dtype: Literal["auto", "float32", "bfloat16"] = option(
        "Compute precision at every layout (fp32 master weights, gradients and reductions either way): "
        "'auto' = bfloat16 where its measured (or spec-sheet) matmul peak is >= 1.5x float32's, else float32; "
        "the banner says which ran and why.",
        "auto")
    elastic_exact: bool = option(
        "Sum each step's micro-batch gradients (and losses) in one fixed tree over the global batch, whatever "
        "ranks hold them, so 1, 2, 4... processes give the same bits and a run can change its number of "
        "processes on resume and stay bit for bit (parallel/elastic.py). Data parallelism only (dp_replicate "
        "and/or dp_shard, no tp/pp/cp/ep); uses the foreach AdamW and a row-wise gradient norm; costs an "
        "all-gather (replicated) or an all-to-all (FSDP) of each step's gradient blocks after backward.", False)
    device: Literal["auto", "cpu", "cuda"] = option(
        "Where to train ('auto' = cuda if available; a device this machine lacks is refused before any worker "
        "starts). `--device` sets it too.", "auto")
    objective: Literal["lm", "contrastive"] = option(
        "What the model learns: 'lm' = next-token prediction; 'contrastive' = an embeddings model "
        "(model.embed_dim > 0) on a pairs dataset (`stalwart data pairs`), InfoNCE with the other pairs of the "
        "micro-batch as negatives.", "lm")
    temperature: float = option("Contrastive objective: the softmax temperature of the cosine similarities.",
                                0.05, min=1e-4, max=10.0)


@dataclass
class ParallelismConfig:
    dp_replicate: int = option("Data-parallel replicas (HSDP outer dimension; 1 = plain FSDP).", 1, min=1)
    data_parallel: Literal["auto", "shard", "replicate"] = option(
        "How the ranks left to data parallelism (dp_replicate = 1, dp_shard = -1) hold the model: 'shard' = "
        "FSDP over them; 'replicate' = each rank holds all of it and gradients are all-reduced (dp_replicate = "
        "the rest, dp_shard = 1); 'auto' = replicate when the job runs on one host, uses no tp/pp/cp/ep, and "
        "every rank's full training state (16 bytes a parameter) fits in a quarter of the memory it has, else "
        "shard. Explicit dp_replicate/dp_shard degrees always win.", "auto")
    dp_shard: int = option("FSDP sharding degree; -1 = whatever the world size leaves over.", -1, min=-1)
    tp: int = option("Tensor-parallel degree (with sequence parallel).", 1, min=1)
    pp: int = option("Pipeline-parallel degree.", 1, min=1)
    cp: int = option("Context-parallel degree.", 1, min=1)
    islands: int = option("Islands (sites): the processes split into this many jobs that train on their own "
                          "and meet only in the outer sync of [islands] (DiLoCo, Streaming DiLoCo, or synchronous "
                          "as the baseline); 1 = one synchronous job.", 1, min=1)
    ep: int = option("Expert-parallel degree: the routed experts are split over this many of the FSDP ranks "
                     "(tokens travel by all-to-all); must divide dp_shard and the number of experts.", 1, min=1)
    reshard_after_forward: bool = option("FSDP: free gathered parameters after forward (less memory, one more "
                                         "all-gather in backward). Always off for pipeline stages.", True)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                         "zbv_zero_bubble", "dualpipe_v"] = option(
        "Pipeline schedule (torch.distributed.pipelining). The interleaved, looped, zero-bubble and V "
        "schedules place several stages on each rank.", "1f1b")
    pp_virtual_stages: int = option("Stages per rank for the interleaved/looped schedules (V schedules use 2).",
                                    2, min=1)
    loss_parallel: bool = option("Tensor parallel: compute the cross-entropy on vocabulary-sharded logits.", True)
    activation_checkpoint: Literal["none", "full", "selective"] = option(
        "Recompute activations in backward: per block ('full') or all but matmul/attention outputs "
        "('selective').", "none")
    compile: bool | Literal["auto"] = option(
        "torch.compile each transformer block (regional: one compiled graph shared by every block; compiled code "
        "kept on disk under the machine's cache, <cache>/compile): 'auto' = compile where one block of the run's "
        "shape, timed eager and compiled on this machine (once, cached with the matmul peaks), is >= 1.05x "
        "faster and the time saved over the run's steps repays the start-up; a run too short to repay any "
        "compile stays eager without measuring it; tp/cp/ep/pp layouts stay eager. The banner says which ran "
        "and why.", "auto")


@dataclass
class DebugConfig:
    dump_grads: list[str] = option("Parameter names whose full gradient is written to <run>/debug/ (safetensors) "
                                   "before clipping, for layout-parity checks.", factory=list)
    dump_steps: int = option("Dump the gradients of this many first steps.", 1, min=0)


@dataclass
class CheckpointConfig:
    interval: int = option("Save every this many steps (0 = only at the end).", 0, min=0)
    resume: str = option("'auto' = continue from the newest complete checkpoint in the run directory if any; "
                         "'none' = start fresh (refuses to overwrite an existing run); or a checkpoint path.",
                         "auto")
    keep_last: int = option("Keep this many newest checkpoints (0 = keep all). The newest complete one is "
                            "never deleted.", 3, min=0)
    at_end: bool = option("Save a checkpoint when training finishes.", True)
    async_save: bool = option("Write checkpoints in a background thread: the loop stalls only to copy the state to "
                              "host memory (one extra host copy of the local shard); the commit happens at a later "
                              "step boundary, the next save, or exit.", True)
    keep_every: int = option("Also keep every checkpoint whose step is a multiple of this forever (0 = none); "
                             "these do not count towards keep_last.", 0, min=0)
    on_failure: Literal["continue", "stop"] = option(
        "What a failed save (disk full, read-only storage) does after logging checkpoint_failed: 'continue' "
        "training (the previous checkpoint stays loadable) or 'stop' with an error.", "continue")
    memory_interval: int = option("Keep an in-memory snapshot of each rank's shard (in /dev/shm, plus a copy on a "
                                  "peer rank) every this many steps (0 = off); resume prefers it when newer than "
                                  "the newest disk checkpoint. Costs 2x the local shard state in host RAM.", 0, min=0)
    memory_dir: str = option("Directory for in-memory snapshots ('' = /dev/shm/stalwart-<hash of run.dir>). Must "
                             "be RAM-backed (tmpfs) and outlive the worker processes.", "")
    demote_after: int = option("A restore whose first this many steps all go non-finite (loss or gradients) "
                               "demotes the state it came from (memory snapshot -> newest disk checkpoint -> "
                               "older ones) and restores from the next; a source is never restored twice "
                               "(<run>/ft/demoted.json). 0 = off.", 3, min=0)
    init_from_hf: str = option("Initialise the weights from a Hugging Face Llama directory (config.json + "
                               "safetensors) when starting fresh, with its tokenizer.json as the run's tokenizer "
                               "('' = seeded random init).", "")


@dataclass
class PublishConfig:
    """Live weights for a running `stalwart serve` (``POST /v1/weights {"source": RUN_DIR, "live": true}``)."""

    interval: int = option("Every this many steps, send the current weights to every server that asked for them "
                           "(in memory, each rank its own shards, over loopback; docs/serving.md). 0 = off: no "
                           "store, no file, nothing per step.", 0, min=0)
    bucket_mb: float = option("Weights go out in buckets of at most this many MiB (a rank holds two at a time).",
                              128.0, min=0.001)
    timeout_s: float = option("How long the trainer ranks wait for a server that asked, and for each transfer to "
                              "it, before they give it up and train on.", 60.0, min=1.0)


@dataclass
class EvalConfig:
    interval: int = option("Evaluate on the held-out split every this many steps (0 = only at the end).",
                           50, min=0)
    batches: int = option("Micro-batches of validation data per evaluation.", 4, min=1)
    at_start: bool = option("Also evaluate once before the first step (the baseline the curve falls from).",
                            True)


@dataclass
class MetricsConfig:
    log_interval: int = option("Write a metrics.jsonl line every this many steps.", 1, min=1)
    fingerprint_sample: int = option(
        "Each logged step's state fingerprint sums the weights and optimizer state of one in this many "
        "parameters (bins balanced by size, in turn by step; the last step sums all of them too, as "
        "fingerprint_full): a changed bit is caught within this many logged steps, a diverging step (which "
        "changes every parameter) at once. 1 = every tensor every time.", 4, min=1)
    peak_tflops: float = option("Peak dense TFLOP/s of one device, in the precision that runs, for MFU; 0 = "
                                "the GPU's spec sheet, or the matmul peak measured on this machine and cached "
                                "in ~/.cache/stalwart/matmul_peaks.json.", 0.0, min=0.0)
    progress: bool = option("Show a progress bar on rank 0 (plain log lines when stdout is not a terminal).",
                            True)


@dataclass
class SampleConfig:
    prompt: str = option("Prompt for the sample printed at the end of training ('' = no sample).", "def ")
    max_new_tokens: int = option("Tokens to generate for the end-of-training sample.", 80, min=0)
    temperature: float = option("Sampling temperature (0 = greedy; at most 2, the engine's range).", 0.8, min=0.0,
                                max=2.0)
    top_k: int = option("Sample among the k most likely tokens (0 = all).", 40, min=0)


@dataclass
class CommConfig:
    """How data-parallel gradients are reduced (the trainer's ``[comm]`` section)."""

    algorithm: Literal["builtin", "auto", "ring", "rd", "rhd", "dbtree", "hier_ring", "hier_rd", "hier2d_ring",
                        "hier2d_rhd"] = option(
        "Gradient all-reduce: 'builtin' (the process group's own), 'auto' (the cost model picks per bucket "
        "size), or one algorithm by name.", "builtin")
    topology: str = option("Topology TOML with calibrated tier costs (e.g. one written by `stalwart bench "
                           "collectives --write_topology`); empty: built-in defaults.", "")
    placement: Literal["detect", "block"] = option(
        "Which host each rank is on: 'detect' asks the ranks (hostname + network namespace), 'block' uses "
        "the topology's ranks_per_host.", "detect")
    bucket_mb: float = option(
        "Gradients are all-reduced in buckets of at most this many MiB when every data-parallel rank holds the "
        "whole model (DDP's bucket_cap_mb, its first bucket 1 MiB); FSDP reduce-scatters per block instead.",
        4.0, min=0.001)
    # 4 MiB: a few buckets per block of the reference model, where DDP's 25 MiB is one for the whole model.
    # Measured 1 / 4 / 25 MiB on the reference workload, two processes: 4915/5601, 5036/5810, 5434/5511
    # tokens/s, inside this machine's noise.
    overlap: bool = option("Run the custom algorithms on a communication thread and prefetch each block's "
                           "all-gather while the previous block computes (false: every collective blocks the "
                           "loop where FSDP issues it).", True)


@dataclass
class ObserveConfig:
    timings: bool = option("Write per-rank, per-phase step timings to timings/rank-<r>.jsonl.", True)
    timings_flush_every: int = option(
        "Flush the per-rank timings file (and resolve CUDA events) every N steps; no collective is "
        "involved, each rank writes its own file and the tools merge them.", 10, min=1)
    flight_recorder: bool = option("Record each rank's last collectives in a ring buffer and dump them to "
                                   "flight/rank-<r>.json on a hang, an exception, SIGTERM or SIGUSR1.", True)
    flight_entries: int = option("Ring-buffer size of the flight recorder (collectives kept per rank).",
                                 2000, min=16)
    hang_timeout_s: float = option(
        "Watchdog: dump the flight recorder when a collective has been in flight, or no progress was "
        "made, for this many seconds (0 = no watchdog thread).", 300.0, min=0.0)
    tensorboard: bool = option("Also write metrics as TensorBoard event files under <run_dir>/tensorboard.",
                               False)
    prometheus_port: int = option(
        "Serve Prometheus metrics (prometheus_client) at http://<host>:<port + local rank>/metrics from every "
        "rank: per-rank step, phase and memory series on each, the run's loss, lr, tokens on rank 0 "
        "(0 = off).", 0, min=0, max=65535)
    prometheus_host: str = option("Address the Prometheus endpoint binds to (loopback by default).",
                                  "127.0.0.1")
    wandb: bool = option("Also log metrics to Weights & Biases (needs the wandb package).", False)
    wandb_project: str = option("Weights & Biases project name.", "stalwart")


@dataclass
class JobConfig:
    run: RunConfig = section(RunConfig, "Run identity and reproducibility.")
    launch: LaunchConfig = section(LaunchConfig, "Local process launching (stalwart train starts workers itself).")
    model: ModelConfig = section(ModelConfig, "Model architecture.")
    data: DataConfig = section(DataConfig, "Training data and tokenizer.")
    optimizer: OptimizerConfig = section(OptimizerConfig, "Optimizer.")
    scheduler: SchedulerConfig = section(SchedulerConfig, "Learning-rate schedule.")
    training: TrainingConfig = section(TrainingConfig, "Training loop.")
    parallelism: ParallelismConfig = section(ParallelismConfig, "Parallel layout of the device mesh.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Checkpointing and resume.")
    publish: PublishConfig = section(PublishConfig, "Live weights from this run to `stalwart serve`.")
    eval: EvalConfig = section(EvalConfig, "Periodic evaluation on held-out data.")
    metrics: MetricsConfig = section(MetricsConfig, "Metrics and progress display.")
    sample: SampleConfig = section(SampleConfig, "Text sample at the end of training.")
    comm: CommConfig = section(CommConfig, "Collective algorithms for data-parallel (FSDP) communication.")
    observe: ObserveConfig = section(ObserveConfig, "Observability: timings, flight recorder, metric sinks.")
    debug: DebugConfig = section(DebugConfig, "Debugging aids (gradient dumps).")
    profile: ProfileConfig = section(ProfileConfig, "Kernel profiler trace and memory snapshot of a few steps.")
    fault: FaultConfig = section(FaultConfig, "Fault tolerance: detection bounds, policies, fault injection.")
    islands: IslandsConfig = section(IslandsConfig, "Training across sites: the islands' outer sync "
                                     "(parallelism.islands).")
    controller: ControllerConfig = section(ControllerConfig, "Single-controller mode (stalwart train --controller).")

    def __post_init__(self) -> None:
        t = self.training
        if t.stop_at_step and t.stop_at_step > t.steps:
            raise ConfigError(f"training.stop_at_step ({t.stop_at_step}) is after training.steps ({t.steps})")
        if t.global_batch % t.micro_batch:
            raise ConfigError(f"training.global_batch ({t.global_batch}) must be a multiple of "
                              f"training.micro_batch ({t.micro_batch})")
        if self.fault.group_recovery:
            p = self.parallelism
            if p.dp_replicate < 2:
                raise ConfigError("fault.group_recovery needs replica groups to fail separately: set "
                                  "--parallelism.dp_replicate to 2 or more")
            if not t.elastic_exact:
                raise ConfigError("fault.group_recovery redoes a lost group's micro-batches in the canonical gradient "
                                  "tree: set --training.elastic_exact true")
            if self.fault.replica_group >= p.dp_replicate:
                raise ConfigError(f"fault.replica_group ({self.fault.replica_group}) must be below "
                                  f"parallelism.dp_replicate ({p.dp_replicate}): groups are numbered from 0")
            if (t.global_batch // t.micro_batch) % p.dp_replicate:
                raise ConfigError(f"fault.group_recovery: the {t.global_batch // t.micro_batch} micro-batches of a "
                                  f"step must split evenly over the {p.dp_replicate} replica groups")
        if self.parallelism.islands > 1:
            check_islands(self.islands, self.parallelism, self.training, self.fault)
        if self.publish.interval and self.parallelism.pp > 1:
            raise ConfigError(f"publish.interval: live weights cannot be sent from a pipeline-parallel layout "
                              f"(parallelism.pp = {self.parallelism.pp}: each stage holds only its layers); serve "
                              "this run's checkpoints instead")

    def notes(self) -> list[str]:
        """Settings that are valid but adjusted; the run prints each once at start."""
        out = []
        if self.scheduler.warmup_steps > self.training.steps:
            out.append(f"note: scheduler.warmup_steps ({self.scheduler.warmup_steps}) exceeds training.steps "
                       f"({self.training.steps}): the warmup is clamped to {self.training.steps} steps")
        return out
