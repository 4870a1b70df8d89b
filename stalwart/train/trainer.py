"""The training loop: ``train`` -> ``train_step`` -> ``forward_backward``.

Everything stateful (model, optimizer, schedule, data position, counters, RNG) is saved and
restored through the checkpoint manager, so a resumed run continues bit-for-bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stalwart import __version__
from stalwart.checkpoint.manager import CheckpointError, CheckpointManager
from stalwart.checkpoint.snapshot import SnapshotStore, default_snapshot_dir
from stalwart.config import to_toml
from stalwart.config.job import JobConfig
from stalwart.data.corpus import Corpus
from stalwart.data.loader import DataLoader, TokenStream, validation_batches
from stalwart.data.tokenizer import build_tokenizer, eos_id, load_tokenizer
from stalwart.ft.guard import StepGuard
from stalwart.generate import sample
from stalwart.metrics.mfu import peak_tflops
from stalwart.metrics.progress import Progress
from stalwart.metrics.records import EventLog
from stalwart.observe import FlightRecorder, PhaseTimer, TimingsWriter, build_sinks
from stalwart.models.flavors import resolve_args
from stalwart.models.llama import Transformer, count_params, flops_per_token
from stalwart.parallel.apply import parallelize
from stalwart.parallel.dims import ParallelDims, build_mesh, virtual_stages
from stalwart.train.dist_env import DistEnv
from stalwart.train.init import materialize_and_init
from stalwart.train.optim import LRSchedule, build_optimizer, clip_grad_norm
from stalwart.train.step import StepRunner


def run_dir_for(cfg: JobConfig) -> Path:
    return Path(cfg.run.dir or f"runs/{cfg.run.name}")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class Trainer:
    def __init__(self, cfg: JobConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.run_dir = run_dir_for(cfg)
        self.device = env.device
        self.param_dtype = torch.bfloat16 if (cfg.training.dtype == "bfloat16" or (
            cfg.training.dtype == "auto" and self.device.type == "cuda")) else torch.float32
        if cfg.run.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(cfg.run.seed)

        self.dims = ParallelDims.resolve(cfg.parallelism, env.world_size)
        if env.is_main and self.dims.tp > env.local_world_size:
            print(f"warning: parallelism.tp = {self.dims.tp} exceeds the {env.local_world_size} processes per host: "
                  "tensor parallelism will cross the inter-host network (see docs/parallelism.md)", flush=True)
        self.events = EventLog(self.run_dir / "events.jsonl", enabled=env.is_main)
        # metrics.jsonl (always) plus the configured sinks (TensorBoard, Prometheus, W&B), rank 0 only.
        self.metrics = build_sinks(cfg.observe, self.run_dir, cfg.run.name, is_main=env.is_main)
        self.recorder = (FlightRecorder(env.rank, env.world_size, self.run_dir, cfg.observe.flight_entries,
                                        cfg.observe.hang_timeout_s).install()
                         if env.is_distributed and cfg.observe.flight_recorder else None)
        self.timer = PhaseTimer(env.rank, env.device, TimingsWriter(self.run_dir, env.rank),
                                cfg.observe.timings_flush_every, enabled=cfg.observe.timings,
                                on_phase=self.recorder.set_phase if self.recorder else None,
                                comm_clock=self.recorder.blocked_seconds if self.recorder else None)
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints", cfg.checkpoint, env.rank, env.world_size, self.events,
            describe={"layout": self.dims.degrees(), "stalwart": __version__, "torch": torch.__version__,
                      "config_sha256": hashlib.sha256(to_toml(cfg).encode()).hexdigest()})
        self.snapshots = None
        if cfg.checkpoint.memory_interval:
            self.snapshots = SnapshotStore(
                cfg.checkpoint.memory_dir or default_snapshot_dir(self.run_dir), env.rank, env.world_size,
                env.local_world_size, layout=self.dims.describe())
        self._refuse_overwrite()

        # Data and tokenizer: rank 0 trains/caches the tokenizer, the others read the cached file.
        self.corpus = Corpus(cfg.data.path, cfg.data.format, cfg.data.text_field, cfg.data.val_fraction)
        tok_path = self.run_dir / "tokenizer.json"
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
            self.tokenizer = build_tokenizer(cfg.data, self.corpus, tok_path)
        _barrier()
        if not env.is_main:
            self.tokenizer = load_tokenizer(tok_path)
        self.eos = eos_id(self.tokenizer)

        # Model: build on meta, parallelize, then materialize and initialise from the seed.
        self.model_args = resolve_args(cfg.model, self.tokenizer.get_vocab_size(), cfg.data.seq_len)
        a = self.model_args
        self.dims.check_model(a.n_heads, a.n_kv_heads, a.n_layers, cfg.data.seq_len,
                              virtual_stages(cfg.parallelism, self.dims))
        self.mesh = build_mesh(self.dims, self.device.type) if env.is_distributed else None
        with torch.device("meta"):
            model = Transformer(a)
        self.pm = parallelize(model, self.dims, self.mesh, cfg.parallelism, self.param_dtype, env.rank, cfg.comm)
        self.model = self.pm.container  # every parameter this rank owns, under its original name
        materialize_and_init(self.model, self.device, cfg.run.seed, stages=self.pm.stages)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg.optimizer, self.model)
        self.schedule = LRSchedule(cfg.scheduler, cfg.optimizer.lr, cfg.training.steps)

        dp_rank = self.dims.dp_rank(env.rank)
        train_stream = TokenStream(self.corpus, self.corpus.train, self.tokenizer, self.eos, cfg.run.seed, True)
        self.loader = DataLoader(train_stream, cfg.data.seq_len, cfg.training.global_batch,
                                 cfg.training.micro_batch, dp_rank, self.dims.dp, cfg.data.shuffle_window,
                                 cfg.run.seed)
        val_stream = TokenStream(self.corpus, self.corpus.val, self.tokenizer, self.eos, cfg.run.seed, True)
        self.val_batches = validation_batches(val_stream, cfg.data.seq_len, cfg.eval.batches * cfg.training.global_batch,
                                              cfg.training.micro_batch, dp_rank, self.dims.dp)
        self.runner = StepRunner(self.pm, self.dims, self.mesh, self.device, env.rank, self.loader.accum_steps,
                                 cfg.parallelism.pp_schedule, self.timer)
        self.pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None

        self.step = 0
        self.tokens_seen = 0
        self.flops_per_token = flops_per_token(a, cfg.data.seq_len)
        peak, self.peak_source = peak_tflops(self.device, self.param_dtype, cfg.metrics.peak_tflops)
        self.peak_flops = peak * 1e12
        self.resumed_from: Path | None = None
        self._resume()
        self.ft = StepGuard(cfg.fault, self.run_dir, env.rank, env.world_size, self.device, self.events)

    # ------------------------------------------------------------------ set-up helpers
    def _refuse_overwrite(self) -> None:
        if self.cfg.checkpoint.resume == "none" and self.checkpoints.complete_checkpoints():
            raise CheckpointError(
                f"run directory {self.run_dir} already holds checkpoints and checkpoint.resume = none; use "
                "--checkpoint.resume auto to continue it, or choose another --run.dir")

    def _resume(self) -> None:
        path = self.checkpoints.resolve_resume()
        disk_step = int(path.name.split("-")[-1]) if path is not None else -1
        snap = self.snapshots.newest_complete_step() if (
            self.snapshots is not None and self.cfg.checkpoint.resume == "auto") else None
        if snap is not None and snap > disk_step:
            st = self.snapshots.load(snap, self.model, self.optimizer)
            source, self.step = "memory", int(st["step"])
            path = self.snapshots.job_dir
        elif path is None:
            if self.cfg.checkpoint.init_from_hf:
                from stalwart.export.hf import load_hf_into
                load_hf_into(self.model, self.model_args, self.cfg.checkpoint.init_from_hf)
                self.events("initialized", source="hf", path=self.cfg.checkpoint.init_from_hf)
            return
        else:
            loaded = self.checkpoints.load(path, self.model, self.optimizer)
            st, source, self.step = loaded.trainer_state, "disk", loaded.step
        self.tokens_seen = int(st["tokens_seen"])
        self.schedule.load_state_dict(st["schedule"])
        self.loader.load_state_dict(st["data"])
        self.resumed_from = path
        self.events("resumed", step=self.step, path=str(path), source=source)

    def trainer_state(self) -> dict:
        return {"tokens_seen": self.tokens_seen, "schedule": self.schedule.state_dict(),
                "data": self.loader.state_dict(), "model_args": to_dict_args(self.model_args)}

    def save_checkpoint(self, block: bool = False) -> Path | None:
        """Start a checkpoint (async: returns after staging); ``block`` waits until it is committed."""
        return self.checkpoints.save(self.step, self.model, self.optimizer, self.trainer_state(), block=block)

    def save_snapshot(self) -> None:
        self.snapshots.save(self.step, self.model, self.optimizer, self.trainer_state())

    # ------------------------------------------------------------------ the loop
    def train_step(self) -> dict:
        t0 = time.perf_counter()
        with self.timer.phase("data"):
            micro = self.loader.next()
        data_wait = time.perf_counter() - t0
        lr = self.schedule.apply(self.optimizer)
        local_loss = self.runner.forward_backward(micro)
        local_loss = self.ft.after_backward(self.step + 1, local_loss, self.params)  # fault injection
        self._maybe_dump_grads()
        with self.timer.phase("optimizer"):
            grad_norm = clip_grad_norm(self.params, self.cfg.training.grad_clip, self.pp_group)
            if self.ft.commit(self.step + 1, local_loss, grad_norm):  # collective; False = skip on all ranks
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.schedule.advance()
        self.step += 1
        tokens = self.cfg.training.global_batch * self.cfg.data.seq_len
        self.tokens_seen += tokens
        loss = self._mean_over_ranks(local_loss)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - t0
        tps = tokens / step_time
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps,
                "mfu": tps * self.flops_per_token / (self.peak_flops * self.env.world_size),
                "step_time_s": step_time, "data_wait_s": data_wait, "mem_bytes": self._memory(),
                "tokens_seen": self.tokens_seen}

    def _mean_over_ranks(self, local: torch.Tensor | None) -> float:
        """Average of the ranks that computed a loss (pipeline ranks without the last stage did not)."""
        pair = torch.zeros(2, dtype=torch.float64, device=self.device)
        if local is not None:
            pair[0], pair[1] = float(local), 1.0
        if self.env.is_distributed:
            dist.all_reduce(pair)
        return float(pair[0] / pair[1])

    def _maybe_dump_grads(self) -> None:
        names = self.cfg.debug.dump_grads
        if not names or self.step >= self.cfg.debug.dump_steps:
            return
        from safetensors.torch import save_file

        from stalwart.train.init import canonical_name

        coords = self.dims.coordinates(self.env.rank)
        writer = all(coords[d] == 0 for d in ("dp_replicate", "dp_shard", "cp", "tp"))
        for name, param in self.model.named_parameters():
            name = canonical_name(name)
            if name not in names or param.grad is None:
                continue
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            if writer:
                out = self.run_dir / "debug"
                out.mkdir(parents=True, exist_ok=True)
                save_file({"grad": grad.detach().float().cpu().contiguous()}, str(out / f"grad-step{self.step + 1}-{name}.safetensors"))

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

    def _memory(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def evaluate(self) -> float:
        loss_sum, count = self.runner.evaluate(self.val_batches)
        total = torch.tensor([loss_sum, count], dtype=torch.float64, device=self.device)
        if self.env.is_distributed:
            dist.all_reduce(total)
        return float(total[0] / total[1])

    def _eval_and_log(self, progress: Progress) -> float:
        eval_loss = self.evaluate()
        self.metrics.write({"step": self.step, "eval_loss": eval_loss, "time": time.time()})
        self.events("eval", step=self.step, eval_loss=eval_loss)
        progress.log(f"step {self.step}: eval loss {eval_loss:.4f}")
        return eval_loss

    def train(self) -> dict:
        cfg = self.cfg
        end = cfg.training.stop_at_step or cfg.training.steps
        progress = Progress(cfg.training.steps, self.step, cfg.metrics.progress, self.env.is_main)
        self.events("start", step=self.step, world_size=self.env.world_size, layout=self.dims.describe(),
                    params=count_params(self.model_args), device=str(self.device),
                    collectives=cfg.comm.algorithm, custom_comm_modules=self.pm.custom_comm_modules)
        progress.log(self._banner())
        if self.step >= end:
            progress.log(f"already at step {self.step} of {cfg.training.steps}: nothing to train "
                         "(raise --training.steps to continue this run)")
        self.ft.start(self.step)
        first_eval = last_eval = None
        if cfg.eval.at_start and self.step == 0:
            first_eval = last_eval = self._eval_and_log(progress)
        t_start, tokens_start, last = time.perf_counter(), self.tokens_seen, {}
        session_start_step = self.step
        steady_t, steady_tokens = None, 0
        while self.step < end:
            self.timer.begin_step(self.step + 1)
            self.ft.before_step(self.step + 1)  # heartbeat; injected kill/hang/exception fire here
            rec = self.train_step()
            self.ft.after_step(rec)  # loss-spike check: may raise RollbackRequested
            last = rec
            if self.step - session_start_step == 3:  # throughput excludes the first (warm-up) steps
                steady_t, steady_tokens = time.perf_counter(), self.tokens_seen
            if self.step % cfg.metrics.log_interval == 0 or self.step == end:
                self.metrics.write({**rec, "time": time.time()})
            progress.update(self.step, f"loss {rec['loss']:.3f}  {rec['tokens_per_s']:.0f} tok/s  "
                                       f"mfu {100 * rec['mfu']:.1f}%")
            if cfg.eval.interval and self.step % cfg.eval.interval == 0 and self.step != end:
                last_eval = self._eval_and_log(progress)
                first_eval = first_eval if first_eval is not None else last_eval
            self.checkpoints.poll()  # commits an async save once every rank's write is durable
            if self.snapshots is not None and self.step % cfg.checkpoint.memory_interval == 0 and self.step != end:
                self.save_snapshot()
            if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0 and self.step != end:
                with self.timer.phase("checkpoint"):
                    self.save_checkpoint()
            self.timer.end_step()
            if self.recorder is not None:
                self.recorder.mark_progress(self.step)
        self.timer.close()
        t_loop_end = time.perf_counter()
        self.ft.finishing(self.step)
        progress.close()
        stopped_early = self.step < cfg.training.steps
        if last:  # evaluate the final weights of this session
            last_eval = self._eval_and_log(progress)
            first_eval = first_eval if first_eval is not None else last_eval
        ckpt = self.resumed_from if isinstance(self.resumed_from, Path) and not last else None
        if (cfg.checkpoint.at_end or stopped_early) and last:  # nothing trained: nothing new to save
            ckpt = self.save_checkpoint(block=True)
        self.checkpoints.wait()  # an in-flight async save commits before exit
        if self.snapshots is not None and not stopped_early:
            self.snapshots.clear()  # finished: the final disk checkpoint supersedes them
        elapsed = time.perf_counter() - t_start
        if steady_t is not None and self.tokens_seen > steady_tokens:
            tps = (self.tokens_seen - steady_tokens) / (t_loop_end - steady_t)
        else:
            tps = (self.tokens_seen - tokens_start) / max(t_loop_end - t_start, 1e-9) if last else None
        summary = {
            "steps": self.step, "stopped_early": stopped_early, "final_loss": last.get("loss"),
            "first_eval_loss": first_eval, "final_eval_loss": last_eval, "tokens_per_s": tps,
            "mfu": tps * self.flops_per_token / (self.peak_flops * self.env.world_size) if tps else None,
            "peak_tflops_per_device": self.peak_flops / 1e12, "peak_source": self.peak_source,
            "world_size": self.env.world_size, "layout": self.dims.describe(), "elapsed_s": elapsed,
            "checkpoint": str(ckpt) if ckpt else None, "run_dir": str(self.run_dir),
            "mem_bytes": self._memory(), **self.state_bytes(),
        }
        summary["sample"] = self._sample() if not stopped_early else None
        summary["fault_tolerance"] = self.ft.summary()
        self.ft.close()
        if self.env.is_main and last:  # a session that trained nothing keeps the previous summary
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.events("stopped" if stopped_early else "finished", step=self.step, **{
            k: summary[k] for k in ("final_loss", "final_eval_loss", "tokens_per_s", "mfu")})
        self.metrics.close()
        self.events.close()
        if self.recorder is not None:
            self.recorder.uninstall()
        return summary

    def _banner(self) -> str:
        a = self.model_args
        src = f"resumed from {self.resumed_from} at step {self.step}" if self.resumed_from else "fresh start"
        return (f"stalwart {__version__}: {count_params(a) / 1e6:.2f}M params (dim {a.dim}, {a.n_layers} layers, "
                f"vocab {a.vocab_size}), {self.env.world_size} process(es) [{self.dims.describe()}] on "
                f"{self.device}, {self.param_dtype}; data: {self.corpus.source}; {src}; peak "
                f"{self.peak_flops / 1e12:.3f} TFLOP/s per device ({self.peak_source})")

    def _sample(self) -> str | None:
        """Gather the full weights onto rank 0 and sample there from a plain single-device model, so
        generation issues no collectives whatever the layout."""
        cfg = self.cfg.sample
        if not cfg.prompt or not cfg.max_new_tokens or self.dims.pp > 1:
            return None  # a pipeline rank holds only its stages: use `stalwart generate` on the checkpoint
        if count_params(self.model_args) > 2e9:
            return None  # too large to gather on one host for a quick sample
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.env.is_main:
            return None
        from stalwart.train.init import canonical_name

        plain = Transformer(self.model_args)
        plain.load_state_dict({canonical_name(k): v for k, v in full.items()})
        prompt = self.tokenizer.encode(cfg.prompt, add_special_tokens=False).ids
        ids = sample(plain, prompt, cfg.max_new_tokens, self.model_args.max_seq_len, cfg.temperature,
                     cfg.top_k, seed=self.cfg.run.seed, eos=self.eos)
        return cfg.prompt + self.tokenizer.decode(ids)


def to_dict_args(args) -> dict:
    import dataclasses

    return dataclasses.asdict(args)


