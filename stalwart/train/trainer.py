"""Pre-training: ``Trainer.train`` -> ``Trainer.step`` -> ``TrainCore.train_step`` -> ``StepRunner.forward_backward``.

The loop trains; the components decide when they act. ``Trainer.__init__`` builds them from their own
config sections: the training core (model, layout, optimizer, schedule), the data, the observer
(records, timings, flight recorder), the guard (heartbeat, non-finite / spike / straggler decisions,
through the optimizer gate), fault injection (only when configured), the evaluator and the
checkpointer (which also chooses what to resume from), and the weight publisher (live weights for
running servers, only when configured). Every stateful piece exposes
``state_dict``/``load_state_dict``, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from stalwart import __version__
from stalwart.atomic import write_text_atomic
from stalwart.config import to_dict, to_toml
from stalwart.config.job import JobConfig
from stalwart.ft.guard import Guard
from stalwart.ft.inject import FaultInjector
from stalwart.metrics.mfu import Peak, peak_tflops, resolve_dtype
from stalwart.models.flavors import resolve_args
from stalwart.models.llama import count_params
from stalwart.parallel.dims import ParallelDims, data_parallel_reason
from stalwart.parallel.regroup import inner_parallelism
from stalwart.paths import RunPaths
from stalwart.train.checkpointer import Checkpointer
from stalwart.train.contrastive import check_objective
from stalwart.train.config_change import describe_changes, previous_config, replace_config
from stalwart.train.core import CoreSpec, TrainCore
from stalwart.train.data_setup import build_run_data
from stalwart.runtime.env import DistEnv
from stalwart.train.dist_env import replica_fits_here
from stalwart.train.evaluator import Evaluator
from stalwart.train.fingerprint import Fingerprinter
from stalwart.train.observer import Observer, TimedLoader
from stalwart.train.publisher import WeightPublisher
from stalwart.train.replicas import ReplicaGroups


def _resolve_precision(requested: str, configured_peak: float, env: DistEnv) -> tuple[torch.dtype, str, Peak]:
    """(compute dtype, why, peak of that dtype): decided by rank 0 (measuring alone, so the figure is
    not shared with the other ranks' measurements) and broadcast, so every rank runs the same dtype."""
    box: list = [None]
    if env.is_main:
        dtype, reason = resolve_dtype(requested, env.device)
        box[0] = (str(dtype).removeprefix("torch."), reason, peak_tflops(env.device, dtype, configured_peak))
    if env.is_distributed:
        dist.broadcast_object_list(box, src=0)
    name, reason, peak = box[0]
    return getattr(torch, name), reason, peak


class Trainer:
    def __init__(self, cfg: JobConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.paths = RunPaths.of(cfg.run)
        # fault.group_recovery: this process's replica group is a job of its own, each rank a whole replica.
        grouped = cfg.fault.group_recovery and cfg.fault.replica_group >= 0
        # parallelism.islands: this process's island is a job of its own; the islands meet in the outer sync.
        islands = cfg.parallelism.islands if cfg.fault.replica_group >= 0 and cfg.parallelism.islands > 1 else 1
        par = inner_parallelism(cfg.parallelism, env.world_size) if grouped else cfg.parallelism
        ParallelDims.resolve(par, env.world_size)  # an impossible layout fails before any work
        if env.is_main and cfg.parallelism.tp > env.local_world_size:
            print(f"warning: parallelism.tp = {cfg.parallelism.tp} exceeds the {env.local_world_size} processes per "
                  "host: tensor parallelism will cross the inter-host network (see docs/parallelism.md)", flush=True)
        Checkpointer.refuse_overwrite(cfg.checkpoint, self.paths)  # before anything in the run is written

        # Data and tokenizer: rank 0 prepares (or checks) the data and caches the tokenizer, then all ranks
        # open the memory-mapped shards.
        self.data = build_run_data(cfg.data, self.paths, env.is_main, cfg.checkpoint.init_from_hf)
        self.tokenizer, self.eos = self.data.tokenizer, self.data.eos
        model_args = resolve_args(cfg.model, self.tokenizer.get_vocab_size(), cfg.data.seq_len)
        Checkpointer.refuse_other_shape(cfg.checkpoint, self.paths, model_args)  # before the run's config changes
        fits = replica_fits_here(env, count_params(model_args))
        dims = ParallelDims.resolve(par, env.world_size, fits)
        self.layout_reason = data_parallel_reason(par, dims, fits)
        check_objective(cfg.training, model_args, self.data.pairs(cfg.data.seq_len), dims)
        # Settings changed since the previous session (a resume with other flags): named at begin().
        self.config_changes = replace_config(self.paths.config, to_toml(cfg)) if env.is_main else {}
        dp_rank = dims.dp_rank(env.rank)
        groups = cfg.parallelism.dp_replicate if grouped else islands
        data = self.data.loader(cfg.data, cfg.data.seq_len, cfg.training.global_batch, cfg.training.micro_batch,
                                max(cfg.fault.replica_group, 0) * dims.dp + dp_rank, groups * dims.dp, cfg.run.seed)
        val_batches = self.data.validation(data, cfg.eval.batches * cfg.training.global_batch,
                                           cfg.training.micro_batch, dp_rank, dims.dp)

        # The observer comes first: the core's phases are timed by its timer.
        dtype, self.dtype_reason, peak = _resolve_precision(cfg.training.dtype, cfg.metrics.peak_tflops, env)
        self.peak_source = peak.describe()
        training = replace(cfg.training, global_batch=cfg.training.global_batch // islands)  # an island's share
        spec = CoreSpec(model_args, par, cfg.comm, cfg.optimizer, cfg.scheduler, training,
                        cfg.data.seq_len, data.accum_steps, cfg.run.seed, cfg.run.deterministic, compute_dtype=dtype,
                        cache_dir=cfg.data.cache)
        self.observer = Observer(cfg.observe, cfg.metrics, self.paths, cfg.run.name, env, spec.flops_per_token,
                                 peak.tflops * 1e12, spec.tokens_per_step, config_dict=to_dict(cfg),
                                 profile_cfg=cfg.profile)
        self.core = TrainCore(spec, env, dims, self.observer.timer)
        comm_thread = self.core.pm.comm_thread
        if comm_thread is not None and self.observer.recorder is not None:
            self.observer.recorder.add_wait_clock(lambda: comm_thread.exposed_s)
        self.data_loader = data
        self.loader = TimedLoader(data, self.observer)
        self.evaluator = Evaluator(cfg.eval, self.core, val_batches, self.observer)
        describe = {"layout": dims.degrees(), "stalwart": __version__, "torch": torch.__version__,
                    "config_sha256": hashlib.sha256(to_toml(cfg).encode()).hexdigest()}
        self.islands = None
        if islands > 1:
            from stalwart.runtime.quorum import open_store
            from stalwart.train.islands import Islands

            store = open_store(cfg.fault.lighthouse, cfg.fault.init_timeout_s)[1] if env.rank == 0 else None
            self.islands = Islands(cfg.islands, cfg.fault.replica_group, islands, env, self.core, store,
                                   model_args.n_layers, self.observer.events, self.observer.say,
                                   cfg.checkpoint.memory_interval or cfg.checkpoint.interval)
        stateful = {"data": data, **({"islands": self.islands} if self.islands else {})}
        self.checkpointer = Checkpointer(cfg.checkpoint, self.paths, env, self.core, stateful,
                                         self.observer.events, describe, phase=self.observer.phase)
        self.fingerprinter = Fingerprinter(self.core.model, self.core.optimizer, data.state_dict,
                                           cfg.metrics.log_interval, cfg.training.stop_at_step or cfg.training.steps,
                                           self.paths.fingerprints, env.is_main, cfg.metrics.fingerprint_sample)
        self.publisher = WeightPublisher(cfg.publish, self.paths, env, self.core.model, self.observer.events,
                                         self.observer.say, self.observer.phase)
        self.state = self.core.state
        self.replicas = None
        if grouped:
            leaves = cfg.training.global_batch // cfg.training.micro_batch
            self.replicas = ReplicaGroups(cfg.fault, env, groups, leaves, self.checkpointer, self.fingerprinter,
                                          self.observer.events, self.observer.say)
            runner = self.core.runner
            runner.use_elastic(self.replicas.exchange(lambda leaf: runner.leaf_value(data.leaf_batch(leaf))),
                               None, self.core.params)
        self.guard = Guard(cfg.fault, self.paths, env.rank, env.world_size, self.observer.events)
        self.core.opt.gates.append(self.guard.gate)
        if self.replicas is not None:
            self.replicas.client.waiting = self.guard.heartbeat.waiting_for_peers
        if self.islands is not None and self.islands.link is not None:
            self.islands.link.waiting = self.guard.heartbeat.waiting_for_peers
            self.islands.link.failed = lambda e: self.observer.say(
                f"island {cfg.fault.replica_group}: the exchange between islands failed ({str(e)[:300]}); waiting "
                "for the lost island to restart")
        self.injector = None
        if FaultInjector.wanted(cfg.fault):
            # A plan's ranks are the job's: group g's rank r is g * (its size) + r under group_recovery.
            job_rank = max(cfg.fault.replica_group, 0) * env.world_size + env.rank
            self.injector = FaultInjector(cfg.fault, self.paths, job_rank, self.guard.attempt)
            self.injector.attach(self.guard, self.core)
        if cfg.debug.dump_grads:
            from stalwart.train.debug import GradientDump

            self.core.backward_hooks.append(GradientDump(cfg.debug, self.paths, self.core, env.rank))
        self.end = cfg.training.stop_at_step or cfg.training.steps

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict:
        # The SIGTERM handler goes in first: the flight recorder's (installed by the observer) dumps, then calls it.
        with self.checkpointer.preemption, self.observer, self.guard, self.injector or contextlib.nullcontext(), \
                self.data_loader, self.publisher:
            self.begin()
            while self.state.step < self.end:
                self.step()
            return self.finish()

    def step(self, batches: list | None = None, data_after: dict | None = None) -> dict:
        """Optimizer step ``state.step + 1``, then the components act (each decides whether this step is
        one it acts on): observed and guarded, trained, logged, evaluated, saved. Returns its record.

        The SPMD loop passes nothing: the batches are the loader's next, read inside the step (its
        ``data`` phase). A controller's trainer actor is fed from outside: it passes this rank's
        ``batches`` and ``data_after``, the data position after them, which the loader takes before the
        checkpointer acts, so that a checkpoint of this step resumes at the right batch."""
        n = self.state.step + 1
        with self.observer.step(n), self.guard.step(n), self.checkpointer.watching():
            record = self.core.train_step(self.loader.next() if batches is None else batches)
        if data_after is not None:
            self.loader.load_state_dict(data_after)
        if self.islands is not None:  # the outer sync of this step, before the step is saved
            self.islands.after_step(n)
            if n == self.cfg.training.steps:
                self.islands.final()
            record.update(self.islands.record())
        self.fingerprinter.maybe_stamp(n, record)
        self.observer.log(record)
        self.evaluator.maybe_run(n, self.end)
        self.checkpointer.maybe_save(n, self.end, record)
        if self.replicas is not None:
            self.replicas.after_step(n)
        self.publisher.maybe_publish(n)
        return record

    def begin(self) -> None:
        """Resume (the checkpointer chooses from what), announce the session, evaluate a fresh start."""
        if self.replicas is not None:  # restored, or sent by another replica group
            self.replicas.begin()
        else:
            self.checkpointer.restore()
        self.start_step = self.state.step
        self.guard.resumed(self.state.step)
        self.observer.begin(self.cfg.training.steps, self.state.step, self.end, self._banner(),
                            layout=self.core.dims.describe(), params=count_params(self.core.spec.model_args),
                            device=str(self.env.device), collectives=self.cfg.comm.algorithm,
                            custom_comm_modules=self.core.pm.custom_comm_modules)
        if self.config_changes:
            self.observer.events("config_changed", changes=self.config_changes,
                                 previous=str(previous_config(self.paths.config)))
            self.observer.say(describe_changes(self.config_changes, self.paths.config))
        for note in [self.layout_reason, *self.cfg.notes()]:
            if note:
                self.observer.say(note)
        if self.state.step >= self.end:
            self.observer.say(f"already at step {self.state.step} of {self.cfg.training.steps}: nothing to train "
                              "(raise --training.steps to continue this run)")
        self.evaluator.at_start(self.state.step)

    def finish(self) -> dict:
        """Final evaluation, save and summary of this session."""
        self.observer.close_step()
        self.guard.finishing()
        trained = self.state.step > self.start_step
        stopped_early = self.state.step < self.cfg.training.steps
        if trained:  # evaluate the final weights of this session
            self.evaluator.run(self.state.step)
        ckpt = self.checkpointer.finish(trained, stopped_early)
        tps = self.observer.throughput()
        # The run's figures span all its sessions (restarts and relaunches): from its records.
        run = self.observer.history()
        session_s = self.observer.elapsed()
        summary = {
            "steps": self.state.step, "stopped_early": stopped_early, "final_loss": self.observer.last.get("loss"),
            "first_eval_loss": run["first_eval_loss"] if run["first_eval_loss"] is not None else self.evaluator.first,
            "final_eval_loss": self.evaluator.last, "tokens_per_s": tps,
            "mfu": self.observer.mfu(tps) if tps else None,
            "peak_tflops_per_device": self.observer.peak_flops / 1e12, "peak_source": self.peak_source,
            "world_size": self.env.world_size, "layout": self.core.dims.describe(),
            "compiled": self.core.compiled, "compile_reason": self.core.compile_reason,
            "elapsed_s": max(session_s, time.time() - run["started"]) if run["started"] else session_s,
            "session_elapsed_s": session_s, "attempts": max(run["attempts"], 1),
            "checkpoint": str(ckpt) if ckpt else None,
            "run_dir": str(self.paths.root), "mem_bytes": self.observer.memory(), **self.core.state_bytes(),
        }
        # an embeddings model has no text to sample
        summary["sample"] = self._sample() if not stopped_early and not self.core.spec.model_args.embed_dim else None
        summary["fault_tolerance"] = self.guard.summary()
        if self.islands is not None:
            summary["islands"] = {"island": self.cfg.fault.replica_group, **self.islands.summary()}
        if self.core.pm.comm_thread is not None:  # the custom collectives, as rank 0 ran them
            summary["custom_collectives"] = self.core.pm.comm_thread.summary()
        if self.env.is_main and trained:  # a session that trained nothing keeps the previous summary
            write_text_atomic(self.paths.summary, json.dumps(summary, indent=1))
        self.observer.events("stopped" if stopped_early else "finished", step=self.state.step, **{
            k: summary[k] for k in ("final_loss", "final_eval_loss", "tokens_per_s", "mfu")})
        return summary

    # ------------------------------------------------------------------ helpers
    def _banner(self) -> str:
        a, env = self.core.spec.model_args, self.env
        resumed = self.checkpointer.resumed_from
        hf = self.checkpointer.initialized_from
        src = (f"resumed from {resumed} at step {self.state.step}" if resumed else
               f"initialised from Hugging Face {hf}" if hf else "fresh start")
        return (f"stalwart {__version__}: {count_params(a) / 1e6:.2f}M params (dim {a.dim}, {a.n_layers} layers, "
                f"vocab {a.vocab_size}), {env.world_size} process(es) [{self.core.dims.describe()}] on "
                f"{env.device}, {self.dtype_reason}, {self.core.compile_reason}; data: {self.data.source}; {src}; "
                f"peak {self.observer.peak_flops / 1e12:.3f} TFLOP/s per device ({self.peak_source})")

    def _sample(self) -> str | None:
        from stalwart.train.sample import sample_from_sharded

        return sample_from_sharded(self.cfg.sample, self.core, self.tokenizer, self.eos, self.cfg.run.seed,
                                   self.env.is_main)
