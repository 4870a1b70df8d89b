"""The `stalwart rl` configuration tree: the task, the warm-up fine-tuning, the GRPO algorithm, the
three meshes (generators, trainers, reward workers) and the sandbox that scores generated programs.

The trainers reuse the training sections (model, optimizer, parallelism, comm), the generators the
inference engine's, the controller its own: one config tree, each component gets its section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stalwart.config.controller import ControllerConfig
from stalwart.config.core import ConfigError, option, section
from stalwart.config.job import (
    CommConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    RunConfig,
    SchedulerConfig,
)
from stalwart.config.sandbox import SandboxConfig
from stalwart.config.serve import EngineConfig


@dataclass
class TaskConfig:
    held_out_fraction: float = option("Share of every problem family's instances kept out of fine-tuning and RL; "
                                      "the final reward is measured on them.", 0.3, min=0.05, max=0.9)
    families: str = option("Problem families to use, comma-separated (empty = all 22; see stalwart/rl/tasks.py).",
                           "")
    tests: int = option("Hidden test cases per problem instance (reward = passed / tests).", 3, min=1, max=50)
    eval_per_family: int = option("Held-out instances per family in an evaluation (a seeded choice, the same at "
                                  "every evaluation; 0 = all held-out instances).", 5, min=0)
    vocab_size: int = option("BPE vocabulary trained on the training instances' prompts and programs.", 512,
                             min=300, max=8192)
    visible_tests: int = option("Visible test cases per instance (drawn apart from the hidden ones): with "
                                "rl.turns > 1 each turn's program runs on them and their first failure is fed "
                                "back to the policy; the reward stays on the hidden tests.", 2, min=1, max=50)

    def family_names(self) -> list[str]:
        return [f.strip() for f in self.families.split(",") if f.strip()]


@dataclass
class SFTConfig:
    examples_per_family: int = option("Training instances per problem family in the warm-up fine-tuning set "
                                      "(0 = no fine-tuning: RL starts from the seeded initialisation).", 2, min=0)
    steps: int = option("Full-batch optimizer steps of the warm-up fine-tuning.", 60, min=0)
    lr: float = option("Learning rate of the warm-up fine-tuning (constant, AdamW).", 1e-3, min=0.0)


Algorithm = Literal["grpo", "dapo", "rloo", "dr_grpo"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
DAPO_CLIP_HIGH = 0.28  # DAPO's clip-higher upper bound (eps_high)


@dataclass
class GRPOConfig:
    algorithm: Algorithm = option(
        "The policy-gradient algorithm: grpo (group-normalised advantages); dapo (grpo's advantages with "
        "clip-higher, token-level loss and dynamic sampling); rloo (leave-one-out baseline); dr_grpo (centred "
        "advantages, token sums over a constant length). Each picks the defaults of clip_high, aggregation, "
        "scale_advantages and dynamic_sampling left unset.", "grpo")
    steps: int = option("RL optimizer steps.", 60, min=1)
    prompts_per_step: int = option("Problem instances per step (each gets group_size responses).", 16, min=1)
    group_size: int = option("Responses per prompt; advantages are relative to the group.", 8, min=2)
    temperature: float = option("Sampling temperature of the rollouts.", 1.0, min=0.05, max=2.0)
    top_k: int = option("Sample among this many most likely tokens (0 = all).", 0, min=0)
    max_tokens: int = option("Longest response, tokens (per turn).", 32, min=1)
    turns: int = option("Turns of an episode: the policy writes a program, the sandbox runs it on the visible "
                        "tests, the first failure is appended, and the policy tries again, up to this many "
                        "programs (an episode stops early once its program passes the visible tests). The "
                        "reward is the last program's on the hidden tests; the loss covers the policy's tokens "
                        "only. 1 = one program per episode.", 1, min=1, max=8)
    feedback_tokens: int = option("Longest feedback appended after a failed turn (the first failing visible "
                                  "case and why), tokens; a longer one is cut and still ends its line.", 32,
                                  min=4)
    clip_low: float = option("PPO clip: the ratio is kept above 1 - clip_low for negative advantages.", 0.2,
                             min=0.0, max=1.0)
    clip_high: float | None = option("PPO clip: the ratio is kept below 1 + clip_high for positive advantages "
                                     f"(unset: {DAPO_CLIP_HIGH} under dapo, its clip-higher; 0.2 otherwise).",
                                     None, min=0.0)
    kl_coef: float = option("Weight of the k3 KL estimate to the frozen reference policy (the fine-tuned model); "
                            "0 = no reference kept.", 0.0, min=0.0)
    aggregation: Aggregation | None = option(
        "How token losses become one number: every response token weighs the same (token-mean), or per response "
        "(the sum of its tokens, that sum over rl.max_tokens, or their mean) then the mean over responses (unset: "
        "seq-mean-token-sum-norm under dr_grpo, token-mean otherwise; dapo takes token-mean only).", None)
    scale_advantages: bool | None = option(
        "Divide advantages by the group's standard deviation (unset: true under grpo and dapo; rloo and dr_grpo "
        "never scale).", None)
    dynamic_sampling: bool | None = option(
        "Train only on groups whose rewards differ: a group that scored alike carries no gradient, and more "
        "groups are sampled and scored in its place (unset: on under dapo, off otherwise).", None)
    dynamic_sampling_rounds: int = option(
        "Dynamic sampling: at most this many extra rounds of generation per step; a step still short of "
        "informative groups then trains with zero-variance groups in the remaining places.", 3, min=1)
    updates_per_step: int = option("Optimizer steps per RL step: the step's groups split into this many "
                                   "mini-batches, trained in turn on the same samples (PPO epochs of one pass; "
                                   "clipping bounds how far the later ones move).", 1, min=1)
    grad_clip: float = option("Clip the global gradient norm to this (0 = no clipping).", 1.0, min=0.0)
    mode: Literal["sync", "async"] = option(
        "sync: generate, score, train, update the generators, in turn; async: the generators produce step "
        "N+1's rollouts while the trainers train on step N's (off-policy by at most rl.max_offpolicy_steps).",
        "sync")
    max_offpolicy_steps: int = option("async: a sample generated by weights version v is trained on at step s only "
                                      "if s - 1 - v <= this (0 = on-policy only); staler samples are dropped and "
                                      "regenerated.", 1, min=0)
    logprobs: Literal["engine", "exact"] = option(
        "Where the old log-probabilities come from: 'engine' = those the generator sampled with (KV-cached "
        "decoding; they differ from the trainer's recompute by rounding, reported as logprob_mismatch); 'exact' = "
        "the generator re-scores each response with the trainer's forward on the trainer's micro-batch shape, so "
        "the mismatch is exactly zero on CPU (costs one forward pass per response, reported as rescore_s); with "
        "parallelism.tp or ep > 1 the trainers score them with their own forward before updating instead (sync "
        "mode only; reported as exact_score_s).",
        "exact")
    routing_replay: bool = option(
        "Mixture-of-experts policy: the generator records every token's experts (top-k per sparse layer) and the "
        "trainers' forward routes each token to them instead of its own top-k (the gate's probabilities of those "
        "experts are still the trainer's, so the router keeps learning); sampler and learner then use the same "
        "experts (reported as routing_flip_frac: the share the trainer would have routed elsewhere). A dense "
        "policy has nothing to replay.", True)
    eval_interval: int = option("Measure the mean reward on the held-out instances every this many steps "
                                "(and at the start and end).", 10, min=1)
    eval_samples: int = option("Samples per held-out instance in an evaluation (at rl.temperature).", 4, min=1)
    weight_sync_bucket_mb: float = option(
        "Weights go from the trainer ranks to the generators in buckets of at most this many MiB (each trainer "
        "rank sends its own shards; a sender holds two buckets at a time, a generator one per trainer rank).",
        128.0, min=0.001)

    def __post_init__(self) -> None:
        """Settings left unset take the algorithm's values; a setting the algorithm cannot take is refused."""
        if self.clip_low >= 1.0:
            raise ConfigError(f"rl.clip_low ({self.clip_low}) must be below 1 (the ratio's lower bound is 1 - clip_low)")
        a = self.algorithm
        if self.clip_high is None:
            self.clip_high = DAPO_CLIP_HIGH if a == "dapo" else 0.2
        if self.aggregation is None:
            self.aggregation = "seq-mean-token-sum-norm" if a == "dr_grpo" else "token-mean"
        elif a == "dapo" and self.aggregation != "token-mean":
            raise ConfigError(f"rl.aggregation = {self.aggregation!r}: dapo's loss is token-level (token-mean); "
                              "unset rl.aggregation or choose another rl.algorithm")
        if self.scale_advantages is None:
            self.scale_advantages = a in ("grpo", "dapo")
        elif self.scale_advantages and a in ("rloo", "dr_grpo"):
            raise ConfigError(f"rl.scale_advantages = true: {a}'s advantages are not divided by the group's "
                              "standard deviation; unset it or choose rl.algorithm grpo")
        if self.dynamic_sampling is None:
            self.dynamic_sampling = a == "dapo"


@dataclass
class RLSchedulerConfig(SchedulerConfig):
    """The RL phase's learning-rate schedule, over its optimizer steps (rl.steps x rl.updates_per_step)."""
    kind: Literal["cosine", "wsd", "constant"] = option(
        "Learning-rate schedule of the RL phase after warmup: cosine decay, warmup-stable-decay (WSD: the peak, "
        "then a linear decay over the last decay_fraction), or constant.", "constant")
    warmup_steps: int = option("Linear warmup optimizer steps from 0 to optimizer.lr.", 0, min=0)


@dataclass
class WorkersConfig:
    generators: int = option("Generators (inference engines), each workers.generator_tp processes.", 1, min=1)
    generator_tp: int = option(
        "Processes per generator: its engine split tensor-parallel over them as `stalwart serve --tp` splits it "
        "(the first schedules and samples, the others follow its steps), each taking its own shards of every "
        "weight sync; with rl.logprobs exact the first also keeps the plain re-scoring copy (the full weights). "
        "A lost process replaces the whole generator.", 1, min=1)
    trainers: int = option("Trainer actors: one process each, one process group, laid out by [parallelism].", 1,
                           min=1)
    device: Literal["auto", "cpu", "cuda"] = option(
        "Where the generator and trainer actors run ('auto' = cuda if available; the GPUs are shared round-robin; a "
        "device this machine lacks is refused before any actor starts); reward workers run on the host. `--device` "
        "sets it too.", "auto")
    reward_workers: int = option("Reward worker actors; each runs up to reward_threads sandboxes at once.", 1,
                                 min=1)
    reward_threads: int = option("Sandboxes one reward worker runs (or asks the sandbox services for) at once.", 2,
                                 min=1)
    sandbox_urls: list[str] = option(
        "Sandbox services (`stalwart rl sandbox --serve`, e.g. http://127.0.0.1:8077) the reward workers send "
        "programs to, spread across them; a busy or unreachable one is skipped and retried with backoff. Empty "
        "= every reward worker runs its own sandboxes. The services' [sandbox] limits apply, not this run's.",
        factory=list)
    sandbox_retry_s: float = option("How long a reward worker keeps trying the sandbox services (all busy or "
                                    "unreachable) for one program before the run stops naming them.", 60.0,
                                    min=0.1)
    reward_timeout_s: float = option("A scoring call still running after this long counts its worker as hung: it "
                                     "is killed and replaced, and its programs are scored again elsewhere.",
                                     120.0, min=1.0)
    snapshot_interval: int = option("Every this many RL steps each trainer keeps an in-memory snapshot of its own "
                                    "shard of the model and optimizer state (and a copy on a peer trainer); a "
                                    "failed trainer costs at most the steps since, replayed from the journal.", 5,
                                    min=1)
    checkpoint_interval: int = option("Every this many RL steps the trainers also write the policy and optimizer "
                                      "to <run>/checkpoints (the newest kept), beside the loop's state, whether "
                                      "or not the step is a snapshot step: a rerun resumes from it when the "
                                      "in-memory snapshots are gone (0 = off).", 0, min=0)
    balance: Literal["fixed", "adaptive"] = option(
        "fixed: the actor counts above for the whole run; adaptive: every balance_window steps, move one worker "
        "between the generator and trainer meshes when the measured generation and training time says the step "
        "would be at least balance_min_gain shorter (changes the trainers' data-parallel degree, so the run is no "
        "longer bitwise reproducible).", "fixed")
    balance_window: int = option("Steps of measurements behind each adaptive balancing decision.", 5, min=1)
    balance_min_gain: float = option("Smallest expected share of the step a move must save.", 0.1, min=0.0, max=1.0)
    generate_timeout_s: float = option("A generation call still running after this long counts its generator as "
                                       "hung (killed, replaced, its prompts generated again).", 300.0, min=1.0)


@dataclass
class RLConfig:
    run: RunConfig = section(RunConfig, "Run identity and reproducibility.")
    model: ModelConfig = section(ModelConfig, "Policy model architecture (the trainers' and generators' one model).")
    optimizer: OptimizerConfig = section(OptimizerConfig, "Optimizer of the RL phase (its schedule: [scheduler]).")
    scheduler: RLSchedulerConfig = section(RLSchedulerConfig, "Learning-rate schedule of the RL phase.")
    parallelism: ParallelismConfig = section(ParallelismConfig, "Parallel layout of the trainer mesh.")
    comm: CommConfig = section(CommConfig, "Collective algorithms of the trainer mesh.")
    engine: EngineConfig = section(EngineConfig, "The generators' inference engine.")
    metrics: MetricsConfig = section(MetricsConfig, "Metrics and progress display.")
    controller: ControllerConfig = section(ControllerConfig, "Actor supervision (poll interval, spares, recovery).")
    task: TaskConfig = section(TaskConfig, "The verifiable code task and its held-out split.")
    sft: SFTConfig = section(SFTConfig, "Warm-up supervised fine-tuning before RL.")
    rl: GRPOConfig = section(GRPOConfig, "The RL algorithm (GRPO, DAPO, RLOO, Dr. GRPO) and the sync/async "
                                         "schedule.")
    workers: WorkersConfig = section(WorkersConfig, "How many actors each mesh has.")
    sandbox: SandboxConfig = section(SandboxConfig, "Where generated programs run: bubblewrap plus rlimits.")

    def trims_rows(self) -> bool:
        """Whether the trainers cut each micro-batch's trailing positions no row trains on
        (``rollout.trim``: the same loss on fewer positions): only where nothing needs the fixed row
        shape, i.e. with the generator's own log-probabilities (exact mode re-scores on that shape) and a
        layout whose forward takes any length (no tensor, context or pipeline split)."""
        p = self.parallelism
        return self.rl.logprobs == "engine" and max(p.tp, p.cp, p.pp) == 1

    def exact_on_trainers(self) -> bool:
        """Whether the trainer mesh computes the exact old log-probabilities itself (a no-grad pass of its own
        forward before the step's first update) instead of the generators' re-scoring copy: a plain
        single-process forward reproduces a replicated or FSDP trainer's numbers bit for bit (the same
        matrix products on gathered weights), but not a tensor-parallel split (partial products summed
        across ranks) or expert parallelism (an expert's rows batched across the ep ranks' micro-batches)."""
        p = self.parallelism
        return self.rl.logprobs == "exact" and max(p.tp, p.ep) > 1

    def __post_init__(self) -> None:
        for url in self.workers.sandbox_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"workers.sandbox_urls: {url!r} is not an http:// or https:// address of a "
                                  "sandbox service (`stalwart rl sandbox --serve` prints it)")
        p = self.parallelism
        if max(p.pp, p.cp) > 1:
            raise ConfigError("the RL trainer mesh runs replicated, FSDP (parallelism.dp_shard), tensor-parallel "
                              "(parallelism.tp) and expert-parallel (parallelism.ep) layouts: set parallelism.pp "
                              "and cp to 1")
        n = self.workers.trainers
        if n % p.tp:
            raise ConfigError(f"parallelism.tp ({p.tp}) must divide workers.trainers ({n})")
        dp = n // p.tp  # data-parallel ranks (pp = cp = 1): the trainers a step's groups are dealt to
        what = f"workers.trainers / parallelism.tp ({n} / {p.tp})" if p.tp > 1 else f"workers.trainers ({n})"
        if self.rl.prompts_per_step % dp:
            raise ConfigError(f"rl.prompts_per_step ({self.rl.prompts_per_step}) must be a multiple of {what}: every "
                              "data-parallel trainer rank trains the same number of groups")
        if self.rl.prompts_per_step % (dp * self.rl.updates_per_step):
            raise ConfigError(f"rl.prompts_per_step ({self.rl.prompts_per_step}) must be a multiple of "
                              f"{what} x rl.updates_per_step ({dp} x {self.rl.updates_per_step}): every "
                              "update gives every data-parallel trainer rank the same number of groups")
        if self.exact_on_trainers() and self.rl.mode == "async":
            raise ConfigError("rl.logprobs = exact with parallelism.tp or ep > 1 needs rl.mode = sync: under these "
                              "layouts the trainers compute the old log-probabilities with their own forward before "
                              "updating, and an async sample's generating weights are gone by then; use rl.mode "
                              "sync or rl.logprobs engine")
        if self.workers.generator_tp > 1 and self.workers.balance == "adaptive":
            raise ConfigError("workers.balance = adaptive moves one process at a time between the meshes, which a "
                              "generator of several processes cannot take; set workers.generator_tp 1 or "
                              "workers.balance fixed")
        if max(p.tp, p.ep) > 1 and self.workers.balance == "adaptive":
            raise ConfigError("workers.balance = adaptive moves one trainer at a time, which a tensor- or "
                              "expert-parallel layout cannot take; set parallelism.tp and ep to 1 or "
                              "workers.balance fixed")
        need = self.rl.prompts_per_step * max(self.rl.group_size, self.rl.eval_samples)
        if self.engine.max_seqs < self.rl.group_size:
            raise ConfigError(f"engine.max_seqs ({self.engine.max_seqs}) must hold at least one group "
                              f"(rl.group_size = {self.rl.group_size}); {need} lets a step's groups run at once")
