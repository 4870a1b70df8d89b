"""The training job's configuration tree: one section per component.

Each component receives only its own section (``build_optimizer(cfg.optimizer, ...)``,
``build_sinks(cfg.observe, ...)``), never the root. Every field's help text is what
``stalwart train --help`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import itertools

from stalwart.config.core import ConfigError, option, section
from stalwart.config.fault_plan import CHAOS_KINDS, FaultPlanError, parse_plan
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
                       "Face `datasets.save_to_disk` directory, tokenized once into <run>/data. Empty = the bundled "
                       "default corpus (this Python's standard library sources).", "")
    mix: str = option("Weights of the prepared dataset's sources, 'NAME:WEIGHT,NAME:WEIGHT' (normalised; a "
                      "source left out gets none). Each global batch holds each source's share to within one "
                      "sequence. Empty = every source by its token count.", "")
    verify: Literal["full", "size"] = option("Checks of a prepared dataset at start (on the first rank): "
                                             "'full' = every shard's sha256, 'size' = presence and sizes only.",
                                             "full")
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
    device: Literal["auto", "cpu", "cuda"] = option("Where to train ('auto' = cuda if available).", "auto")


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
    compile: bool = option("torch.compile each transformer block.", False)


def validate_timeouts(heartbeat_interval_s: float, heartbeat_timeout_s: float, progress_timeout_s: float,
                      collective_timeout_s: float, init_timeout_s: float) -> None:
    """Each detector must fire before the mechanism behind it would: a clear error otherwise."""
    chain = [("fault.heartbeat_interval_s", heartbeat_interval_s), ("fault.heartbeat_timeout_s", heartbeat_timeout_s),
             ("fault.progress_timeout_s", progress_timeout_s), ("fault.collective_timeout_s", collective_timeout_s),
             ("fault.init_timeout_s", init_timeout_s)]
    for (a, va), (b, vb) in itertools.pairwise(chain):
        if not va < vb:
            raise ConfigError(
                f"{a} ({va:g} s) must be smaller than {b} ({vb:g} s): the timeouts must be ordered "
                "heartbeat interval < heartbeat timeout < progress timeout < collective timeout < init timeout, "
                "so a hang is caught by the watchdog before torch's collective timeout turns it into a crash")


@dataclass
class ControllerConfig:
    step_timeout_s: float = option(
        "stalwart train --controller: a command (a training step, a restore) still running on an actor after this "
        "many seconds counts as a hang; the controller kills that actor (SIGKILL), names it, and recovers.",
        300.0, min=1.0)
    supervision_poll_s: float = option(
        "How often Monarch polls the actor processes for deaths (HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY); "
        "a killed actor is reported within about this long.", 0.5, min=0.05, max=60.0)
    spares: int = option("Started spare actors (their imports done) that take a failed actor's place at once; "
                         "each is one idle process. 0 = start a new process per failure.", 1, min=0)
    max_recoveries: int = option("Actor failures the controller recovers from before it gives up (exit 75).", 3,
                                 min=0)
    recover_from: Literal["memory", "disk"] = option(
        "What a recovery restores before replaying the command journal: 'memory' keeps the surviving actors and "
        "restores every actor from the newest in-memory snapshot (checkpoint.memory_interval); 'disk' respawns "
        "every actor and loads the newest disk checkpoint (what a restart of an SPMD job does). Without a state "
        "of either kind the journal is replayed from the seeded initialisation.", "memory")


@dataclass
class FaultConfig:
    inject: str = option("Fault-injection plan for tests and drills, e.g. 'kill:rank=1,step=17;hang:rank=0,step=30;"
                         "nan:step=40;slow:rank=1,factor=3,steps=50-80;exception:rank=0,step=60;"
                         "corrupt_checkpoint:step=50'. Each fault fires once (recorded in <run>/ft/fired/); "
                         "'once=0' repeats it on every attempt. '' = none.", "")
    chaos_mtbf_s: float = option("Chaos drill: the supervisor injects random faults (fault.chaos_kinds) into random "
                                 "ranks with this mean time between failures in seconds (0 = off).", 0.0, min=0.0)
    chaos_seed: int = option("Seed of the chaos schedule (equal seeds give equal fault times, kinds and ranks).",
                             0, min=0)
    chaos_kinds: list[str] = option("Fault kinds chaos draws from: kill (SIGKILL), hang (SIGSTOP), exception "
                                    "(SIGUSR2 raises in the worker).", factory=lambda: ["kill", "hang", "exception"])
    heartbeat_interval_s: float = option("Each rank's heartbeat thread writes <run>/ft/heartbeat/rank-<r>.json this "
                                         "often.", 0.5, min=0.01)
    heartbeat_timeout_s: float = option("A rank whose heartbeat is older than this is unresponsive: the supervisor "
                                        "kills and restarts the group.", 10.0, min=0.01)
    progress_timeout_s: float = option("A rank that completes no step for this long (stuck in a collective or in "
                                       "compute) is hung: the group is killed and restarted. Must exceed the "
                                       "longest step, evaluation and checkpoint stall.", 120.0, min=0.01)
    collective_timeout_s: float = option("Process-group timeout of every collective (torch's default is 30 min); "
                                         "a backstop behind the progress watchdog.", 300.0, min=0.01)
    init_timeout_s: float = option("Start-up (rendezvous, building, resume) until the first step completes, and "
                                   "the end of training (final eval/checkpoint), may take this long.", 900.0,
                                   min=0.01)
    kill_grace_s: float = option("After SIGTERM to a hung group, wait this long before SIGKILL.", 2.0, min=0.0)
    monitor_interval_s: float = option("How often the supervisor polls worker exit codes and heartbeats.", 0.1,
                                       min=0.01)
    crash_loop_restarts: int = option("Stop with exit code 76 ('do not requeue') after this many failures in a row "
                                      "with no progress (the newest snapshot/checkpoint step did not advance); "
                                      "0 = never.", 3, min=0)
    exclude_after: int = option("Exclude a host after this many failures attributed to it (0 = never): the job "
                                "restarts without it, on fewer data-parallel ranks with the same global batch "
                                "(more gradient accumulation), and records it in <run>/ft/excluded.json.", 0,
                                min=0)
    spare_hosts: int = option("Spare hosts in reserve: while any remain, an excluded host is replaced by one "
                              "(same world size, so the same trajectory) instead of shrinking the job. On one "
                              "machine the spare is local capacity; across nodes, start standby nodes in "
                              "torchrun's elastic range (--nnodes MIN:MAX).", 0, min=0)
    host_size: int = option("Ranks per host for exclusion (0 = launch.nproc_per_node, i.e. a real host; tests "
                            "use 1 so one local process stands for a host).", 0, min=0)
    nonfinite: Literal["skip", "rollback", "off"] = option(
        "Non-finite loss or gradients on any rank: 'skip' the step on every rank (weights and optimizer state, "
        "AdamW step counters included, unchanged), 'rollback' to the last good state skipping that step, or 'off'.",
        "skip")
    spike_zscore: float = option("Loss spike: a loss whose robust z-score (median/MAD over fault.spike_window "
                                 "steps) exceeds this rolls back to the last good state and skips the offending "
                                 "steps (needs the supervisor's restarts, see launch.max_restarts; otherwise only reported). 0 = off; 8 is a "
                                 "reasonable start.", 0.0, min=0.0)
    spike_window: int = option("Trailing steps the loss-spike statistics use (it needs half of them first).", 32,
                               min=4)
    spike_skip_steps: int = option("Steps of data skipped after a spike, ending at the spike step.", 1, min=1)
    straggler_threshold: float = option("A rank whose median forward/backward time over fault.straggler_window "
                                        "steps is this many times its peers' is reported as a straggler (0 = off).",
                                        2.0, min=0.0)
    straggler_window: int = option("Steps the straggler detector looks at.", 8, min=2)
    straggler_policy: Literal["report", "exclude"] = option(
        "'report' = straggler event and summary line; 'exclude' = also record the rank's host in "
        "<run>/ft/excluded.json for the next launch.", "report")

    def __post_init__(self) -> None:
        validate_timeouts(self.heartbeat_interval_s, self.heartbeat_timeout_s, self.progress_timeout_s,
                          self.collective_timeout_s, self.init_timeout_s)
        parse_plan(self.inject)
        bad = [k for k in self.chaos_kinds if k not in CHAOS_KINDS]
        if bad:
            raise FaultPlanError(f"fault.chaos_kinds: {bad[0]!r} is not one of {', '.join(CHAOS_KINDS)}")


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
    init_from_hf: str = option("Initialise the weights from a Hugging Face Llama directory (config.json + "
                               "safetensors) when starting fresh ('' = seeded random init).", "")


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
    peak_tflops: float = option("Peak dense TFLOP/s of one device, in the precision that runs, for MFU; 0 = "
                                "the GPU's spec sheet, or the matmul peak measured once per machine and cached "
                                "in ~/.cache/stalwart/matmul_peaks.json.", 0.0, min=0.0)
    progress: bool = option("Show a progress bar on rank 0 (plain log lines when stdout is not a terminal).",
                            True)


@dataclass
class SampleConfig:
    prompt: str = option("Prompt for the sample printed at the end of training ('' = no sample).", "def ")
    max_new_tokens: int = option("Tokens to generate for the end-of-training sample.", 80, min=0)
    temperature: float = option("Sampling temperature (0 = greedy).", 0.8, min=0.0)
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
    bucket_mb: float = option("Gradients are flattened into buckets of at most this many MiB per all-reduce.",
                              25.0, min=0.001)


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
    eval: EvalConfig = section(EvalConfig, "Periodic evaluation on held-out data.")
    metrics: MetricsConfig = section(MetricsConfig, "Metrics and progress display.")
    sample: SampleConfig = section(SampleConfig, "Text sample at the end of training.")
    comm: CommConfig = section(CommConfig, "Collective algorithms for data-parallel (FSDP) communication.")
    observe: ObserveConfig = section(ObserveConfig, "Observability: timings, flight recorder, metric sinks.")
    debug: DebugConfig = section(DebugConfig, "Debugging aids (gradient dumps).")
    profile: ProfileConfig = section(ProfileConfig, "Kernel profiler trace and memory snapshot of a few steps.")
    fault: FaultConfig = section(FaultConfig, "Fault tolerance: detection bounds, policies, fault injection.")
    controller: ControllerConfig = section(ControllerConfig, "Single-controller mode (stalwart train --controller).")

    def __post_init__(self) -> None:
        t = self.training
        if t.stop_at_step and t.stop_at_step > t.steps:
            raise ConfigError(f"training.stop_at_step ({t.stop_at_step}) is after training.steps ({t.steps})")
        if t.global_batch % t.micro_batch:
            raise ConfigError(f"training.global_batch ({t.global_batch}) must be a multiple of "
                              f"training.micro_batch ({t.micro_batch})")

    def notes(self) -> list[str]:
        """Settings that are valid but adjusted; the run prints each once at start."""
        out = []
        if self.scheduler.warmup_steps > self.training.steps:
            out.append(f"note: scheduler.warmup_steps ({self.scheduler.warmup_steps}) exceeds training.steps "
                       f"({self.training.steps}): the warmup is clamped to {self.training.steps} steps")
        return out
