"""``stalwart rl``: one controller program drives three actor meshes through the single-controller API
(``stalwart.controller.mesh``): generators (the inference engine with versioned weight updates),
trainers (the training core under the configured parallel layout) and reward workers (the sandbox).

A run: train a tokenizer on the training instances; warm the policy up by supervised fine-tuning on a
few examples (on the trainer mesh); the trainers send their weights to the generators as version 0;
then per RL step: generate the step's groups, score them, compute group-relative advantages, train
one optimizer step, and send the new weights as the next version. In ``async`` mode the generators
work on the next steps' groups while the trainers train (at most ``rl.max_offpolicy_steps`` versions
stale; a staler group is generated again). Held-out instances are evaluated at the start, every
``rl.eval_interval`` steps and at the end.

The controller holds no weights: they go from the trainer ranks to the generators directly
(``rl/weights.py``), and each trainer keeps its own snapshot every ``workers.snapshot_interval``
steps. It journals every step (the groups it trains on, their versions, the applied result) in
``controller/journal.jsonl`` and keeps the trainer rows since the snapshot: a trainer that fails is
replaced, every trainer restores the snapshot, and the steps since are replayed; a replayed step must
reproduce its journaled loss.

The controller's own crash loses nothing either: before each trainer snapshot the loop's state of
that step goes to ``<run>/controller/rl-state`` (``rl/state.py``), the snapshots outlive every process
in ``/dev/shm`` (and the trainers also write a disk checkpoint every ``workers.checkpoint_interval``
steps), and the same command run again resumes from the newest of them, skipping the warm-up, and
computes again the steps the journal holds results of, checked against them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import time
from typing import Any

import numpy as np

from stalwart.config.render import to_toml
from stalwart.config.rl import RLConfig
from stalwart.controller.journal import Journal, earlier_results
from stalwart.controller.gang import GangMesh
from stalwart.controller.mesh import ActorMesh, ActorsFailed, configure_monarch
from stalwart.controller.replay import RecoveriesExhausted, ReplayDiverged
from stalwart.errors import UserError
from stalwart.metrics.records import EventLog, JsonlWriter
from stalwart.parallel.dims import ParallelDims
from stalwart.paths import RunPaths
from stalwart.rl import rollout
from stalwart.rl.episode import EpisodeSpec, segments
from stalwart.rl.loop import RunContext, Services, Stepper, sft
from stalwart.rl.pools import Pool
from stalwart.rl.progress import RLProgress
from stalwart.rl.services import SETUP_S, Generators, Rewards, Timeouts, Trainers
from stalwart.rl.setup import TaskSetup, build_tokenizer, max_prompt_tokens, prompt_text
from stalwart.rl.state import Checks, StateFiles, capture, resumable, resume, rewind_metrics, run_key
from stalwart.rl.weights import WeightSync

class RLDriver:
    def __init__(self, cfg: RLConfig) -> None:
        from stalwart.data.tokenizer import eos_id
        from stalwart.models.flavors import resolve_args
        from stalwart.runtime.group import controller_store

        run = dataclasses.replace(cfg.run, dir=str(RunPaths.of(cfg.run).root.resolve()))
        self.cfg = cfg = dataclasses.replace(cfg, run=run)
        self.paths = RunPaths.of(cfg.run)
        self.task = TaskSetup.of(cfg)
        self.key = run_key(cfg)
        self.states = StateFiles(self.paths.rl_state)
        self.point = resumable(self.paths, self.key)  # (source, step) to resume from, or None
        self.resumed: dict[str, Any] | None = None
        if self.point is not None:  # the counts the run had then (adaptive balancing changes them)
            layout = self.states.read(self.point[1])["layout"]
            self.cfg = cfg = dataclasses.replace(cfg, workers=dataclasses.replace(cfg.workers, **layout))
        self.paths.root.mkdir(parents=True, exist_ok=True)
        self.paths.config.write_text(to_toml(cfg))
        self.events = EventLog(self.paths.events)
        self.metrics = JsonlWriter(self.paths.metrics)
        self.progress = RLProgress(cfg.rl.steps, cfg.metrics.progress)
        self.tok = build_tokenizer(self.task, cfg.task.vocab_size)
        self.paths.tokenizer.write_text(self.tok.to_str(pretty=True))
        self.eos = eos_id(self.tok)
        self.pad = self.eos
        self.prompt_len = max_prompt_tokens(self.tok, self.task.train + self.task.evaluated)
        self.length = rollout.row_length(self.prompt_len, cfg.rl.max_tokens, cfg.rl.turns, cfg.rl.feedback_tokens)
        self.length += -self.length % cfg.parallelism.tp  # sequence parallelism cuts rows into tp equal shards
        self.args = resolve_args(cfg.model, self.tok.get_vocab_size(), self.length + 1)
        a = self.args  # the trainers' layout against the model, before any actor starts (one line, exit 2)
        ParallelDims.resolve(cfg.parallelism, cfg.workers.trainers).check_model(
            a.n_heads, a.n_kv_heads, a.n_layers, self.length, 1, a.moe.n_experts if a.moe else 0)
        tp = cfg.workers.generator_tp
        if a.n_heads % tp or a.n_kv_heads % tp:
            raise UserError(f"workers.generator_tp ({tp}) must divide the model's attention heads ({a.n_heads}) and "
                            f"key/value heads ({a.n_kv_heads}): each generator process holds whole heads")
        self.store = controller_store(cfg.workers.trainers, SETUP_S)
        if self.point is None:  # the trainers' snapshots and the loop's states: this run's only
            shutil.rmtree(self.paths.snapshots(), ignore_errors=True)
            shutil.rmtree(self.paths.rl_state, ignore_errors=True)
        self.journal: Journal | None = None
        self.svc: Services | None = None
        self.checks = Checks({}, True, self.events)
        self.figures: dict[str, Any] = {}  # the warm-up's figures and the first evaluation (kept in the state)
        self.finished = False
        self.t0 = time.time()

    # ------------------------------------------------------------------ services
    def _spawn(self) -> Services:
        from stalwart.rl.generator import GeneratorActor
        from stalwart.rl.reward import RewardActor
        from stalwart.rl.trainer import PolicyTrainerActor
        from stalwart.runtime.group import abandon_attempt
        from stalwart.runtime.standalone import abandon

        cfg, w, spares = self.cfg, self.cfg.workers, self.cfg.controller.spares
        used = self.task.train + self.task.evaluated
        timeouts = Timeouts(cfg.controller.step_timeout_s, SETUP_S, w.generate_timeout_s)
        meshes = {"trainers": ActorMesh.spawn(PolicyTrainerActor, "trainer", w.trainers, spares),
                  "generators": GangMesh.spawn(GeneratorActor, "generator", w.generators, spares,
                                               width=w.generator_tp),
                  "rewards": ActorMesh.spawn(RewardActor, "reward", w.reward_workers, spares)}
        self.meshes = list(meshes.values())
        for mesh in self.meshes:
            mesh.report_grace_s = cfg.controller.supervision_poll_s + 0.25
            for r, pid in mesh.call_all(mesh.actor_cls.warm, (), SETUP_S).items():
                mesh.pids[r] = pid
        trainers = Trainers(meshes["trainers"], cfg, self.store.port, str(self.paths.snapshots()), timeouts,
                            lambda attempt: abandon_attempt(self.store, attempt))
        r = cfg.rl
        sampling = {"max_tokens": r.max_tokens, "temperature": r.temperature, "top_k": r.top_k,
                    "record_routing": r.routing_replay and self.args.moe is not None}
        gen_pool = Pool(meshes["generators"], "generator", w.generate_timeout_s, self.events, lambda g: None)
        episode = None if r.turns == 1 else EpisodeSpec(
            r.turns, r.feedback_tokens, {i.key: [(c.input, c.output) for c in i.visible_cases(
                cfg.task.visible_tests, cfg.run.seed, cfg.task.tests)] for i in used},
            (cfg.sandbox, w.reward_threads, w.sandbox_urls, w.sandbox_retry_s))
        generators = Generators(gen_pool, {i.key: self.tok.encode(prompt_text(i)).ids for i in used},
                                (self.args, self.tok.to_str(), cfg.engine, sampling,
                                 r.logprobs == "exact" and not cfg.exact_on_trainers(),
                                 self.length, self.pad, w.device, episode), self.store.port, timeouts)
        rew_pool = Pool(meshes["rewards"], "reward", w.reward_timeout_s, self.events, lambda g: None)
        rewards = Rewards(rew_pool, {i.key: [(c.input, c.output) for c in i.cases(cfg.task.tests, cfg.run.seed)]
                                     for i in used}, self._program,
                          (cfg.sandbox, w.reward_threads, w.sandbox_urls, w.sandbox_retry_s))
        rew_pool.restore = lambda rank: rewards.setup([rank])
        weights = WeightSync(trainers, generators, self.events, lambda prefix: abandon(self.store, prefix),
                             str(self.paths.reference))
        gen_pool.restore = weights.bring_up
        self.events("rl_meshes", **{name: dict(m.pids) for name, m in meshes.items()},
                    generator_members=dict(meshes["generators"].members))
        return Services(trainers, generators, rewards, weights)

    def _program(self, response: list[int]) -> str:
        ids = response[:-1] if response and response[-1] == self.eos else response
        return self.tok.decode(ids)

    def evaluate(self, tag: str) -> dict[str, Any]:
        reqs = rollout.eval_plan(self.cfg.run.seed, self.task.evaluated, self.cfg.rl.eval_samples, tag)
        groups, fig = self.svc.generators.run(reqs)
        self.svc.rewards.score(groups)
        fam: dict[str, list[float]] = {}
        examples: dict[str, dict[str, Any]] = {}
        for g in groups:
            inst = g.request.instance
            fam.setdefault(inst.family, []).extend(g.rewards)
            if inst.family not in examples:  # one response per family, to read what the policy writes
                examples[inst.family] = {"prompt": inst.prompt, "program": self._program(g.programs()[0]),
                                         "reward": g.rewards[0], "verdict": g.verdicts[0]}
                if g.masks is not None:  # the whole episode: program, feedback, program, ...
                    examples[inst.family]["conversation"] = [
                        self._program(part) if policy else self.tok.decode(part)
                        for policy, part in segments(g.responses[0], g.masks[0])]
        allr = [x for g in groups for x in g.rewards]
        out = {"held_out_reward": float(np.mean(allr)), "per_family": {k: float(np.mean(v)) for k, v in sorted(fam.items())},
               "held_out_instances": len(groups), "examples": examples}
        if "turns_mean" in fig:  # several turns: what the first programs alone would have scored
            first = [rollout.Group(g.request, g.prompt, [rollout.first_turn(r, m) for r, m in zip(g.responses, g.masks)],
                                   g.logprobs, g.version) for g in groups]
            self.svc.rewards.score(first)
            out.update(held_out_reward_turn1=float(np.mean([x for g in first for x in g.rewards])),
                       turns_mean=fig["turns_mean"])
        return out

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        configure_monarch(self.cfg.controller.supervision_poll_s)
        self.events("launch", engine="rl-controller", mode=self.cfg.rl.mode)
        try:
            w = self.cfg.workers
            gens = f"{w.generators} generator" + (f" (x{w.generator_tp} processes)" if w.generator_tp > 1 else "")
            self.progress.phase(f"spawning {w.trainers} trainer, {gens} and {w.reward_workers} "
                                f"reward actor(s) on {w.device}")
            self.svc = self._spawn()
            return self._run()
        finally:
            self.progress.close()
            for mesh in getattr(self, "meshes", []):
                mesh.stop()
            if self.finished:  # else they are what a rerun resumes from
                shutil.rmtree(self.paths.snapshots(), ignore_errors=True)
            if self.journal is not None:
                self.journal.close()
            self.metrics.close()
            self.events("supervisor_exit", engine="rl-controller")
            self.events.close()

    def _context(self) -> RunContext:
        return RunContext(self.cfg, self.task, self.args, self.length, self.pad, self.journal, self.metrics,
                          self.events, self.progress, self.evaluate, self._eval_record, str(self.paths.rebalance),
                          self.store, self.t0, self._keep_state, lambda *a: self.checks(*a))

    def _run(self) -> dict[str, Any]:
        cfg, svc = self.cfg, self.svc
        self.journal = Journal(self.paths.journal)
        ctx = self._context()
        svc.trainers.join()
        svc.generators.setup()
        svc.rewards.setup()
        state = self._resume() if self.point is not None else None
        if state is None:
            self._warm_up(ctx)
        step, source = (state["step"], self.point[0]) if state is not None else (0, "init")
        earlier = earlier_results(self.journal.entries, step, self.key)
        self.journal.append("session", step=step, config=self.key, source=source, checks=len(earlier),
                            layout={"generators": svc.generators.n, "trainers": svc.trainers.n})
        self.checks = Checks(earlier, cfg.rl.mode == "sync", self.events)
        stepper = Stepper(ctx, svc)
        if state is not None:
            resume(stepper, state, {i.key: i for i in self.task.train + self.task.evaluated})
            self.resumed = {"step": step, "source": source, "checks": len(earlier)}
            self.events("rl_resumed", **self.resumed, pending_groups=sum(len(g) for g in state["pending"].values()))
            self.progress.phase(f"resumed at RL step {step} from the trainers' {source} state; {len(earlier)} "
                                "journaled step(s) after it are computed again and checked")
            if source == "disk":  # an in-memory snapshot to recover a trainer from in this session
                stepper.take_snapshot(step)
        curve = stepper.run()
        if self.resumed is not None:
            self.resumed.update(checks_matched=self.checks.matched, checks_differed=self.checks.differed)
        sft_fig, start = self.figures["sft"], self.figures["start"]
        self.progress.phase("final evaluation on the held-out instances")
        final = self.evaluate("final")
        self._eval_record(cfg.rl.steps, final)
        curve["policy"] = self._write_policy(self.paths.policy, "policy")
        self.finished = True
        return self._summary(sft_fig, start, final, curve)

    def _warm_up(self, ctx: RunContext) -> None:
        """A fresh run's start: fine-tuning, the reference (with a KL term), version 0 to every generator,
        the first evaluation."""
        cfg, svc = self.cfg, self.svc
        self.progress.phase(f"SFT warm-up: {cfg.sft.steps} steps on {len(self.task.sft)} examples")
        sft_fig = sft(ctx, svc, self.tok, self.eos)
        if cfg.rl.kl_coef > 0:  # the fine-tuned policy is the frozen reference: on disk once, then to every generator
            self._write_policy(self.paths.reference, "reference")
            svc.weights.settle(svc.weights.publish(0, reference=True))
        svc.weights.settle(svc.weights.publish(0))
        self.progress.phase("evaluating the fine-tuned policy on the held-out instances")
        start = self.evaluate("start")
        self._eval_record(0, start)
        self.figures = {"sft": sft_fig, "start": start}
        self.progress.phase(f"held-out reward {start['held_out_reward']:.3f} after fine-tuning; "
                            f"{cfg.rl.steps} RL steps ({cfg.rl.mode})")
        self.events("rl_start", held_out_reward=start["held_out_reward"], train_instances=len(self.task.train),
                    held_out_instances=len(self.task.held_out),
                    evaluated_instances=len(self.task.evaluated), sft_examples=len(self.task.sft), mode=cfg.rl.mode)

    def _resume(self) -> dict[str, Any]:
        """A rerun's start (``self.point``): the RL phase's core, the trainers' state of the resumed step
        (their in-memory snapshot, else the disk checkpoint), the reference from disk, that step's weights
        to every generator; returns the loop's state of the step."""
        from stalwart.checkpoint.manager import newest_complete_checkpoint

        cfg, svc = self.cfg, self.svc
        source, step = self.point
        state = self.states.read(step)
        rewind_metrics(self.paths.metrics, step, cfg.rl.steps)  # before this session writes a row
        info = svc.trainers.build("rl", self.args, self.length, cfg.rl.prompts_per_step // svc.trainers.dp,
                                  cfg.rl.steps)
        self.events("rl_trainers", layout=info["layout"], params=info["params"], sft_examples=len(self.task.sft))
        got = (svc.trainers.restore(step) if source == "memory" else
               svc.trainers.load_checkpoint(str(newest_complete_checkpoint(self.paths.checkpoints))))
        if got != step:
            raise RuntimeError(f"the trainers restored step {got} from {source}, the loop's state is of step {step}")
        if cfg.rl.kl_coef > 0:  # the reference policy went to disk before the first RL step
            w = svc.weights
            w.join_links(list(range(svc.generators.n)))
            for g in range(svc.generators.n):
                svc.generators.load_reference(g, w.reference_run)
            w.has_reference = True
        svc.weights.settle(svc.weights.publish(step))
        self.figures = {"sft": state["sft"], "start": state["start"]}
        return state

    def _keep_state(self, step: int, stepper: Stepper) -> None:
        """The loop's state of ``step`` (before the trainers' snapshot of it), and every
        ``workers.checkpoint_interval`` steps the trainers' disk checkpoint after it."""
        from stalwart.checkpoint.manager import newest_complete_checkpoint
        from stalwart.paths import checkpoint_step

        interval = self.cfg.workers.checkpoint_interval
        disk = bool(interval) and step > 0 and step % interval == 0
        newest = newest_complete_checkpoint(self.paths.checkpoints)
        keep = ({checkpoint_step(newest)} if newest is not None else set()) | ({step} if disk else set())
        self.states.write({**capture(stepper, step), "config": self.key, **self.figures}, keep)
        if disk:
            self.svc.trainers.save_checkpoint(str(self.paths.checkpoints))

    def _write_policy(self, root, what: str) -> str:
        """The current policy as a run directory of its own: a training config that names its model
        shape, the tokenizer, and a checkpoint the trainers write in Stalwart's checkpoint format (each
        rank its own shards)."""
        from stalwart.config.job import DataConfig, JobConfig, RunConfig

        out = RunPaths(root)
        out.root.mkdir(parents=True, exist_ok=True)
        job = JobConfig(run=RunConfig(name=f"{self.cfg.run.name}-{what}", dir=str(out.root), seed=self.cfg.run.seed),
                        model=self.cfg.model, data=DataConfig(seq_len=self.length + 1))
        out.config.write_text(to_toml(job))
        out.tokenizer.write_text(self.tok.to_str(pretty=True))
        return self.svc.trainers.save_checkpoint(str(out.checkpoints))

    def _eval_record(self, step: int, ev: dict[str, Any]) -> None:
        self.metrics.write({"step": step, "kind": "eval", "held_out_reward": ev["held_out_reward"],
                            "elapsed_s": time.time() - self.t0,
                            **{k: ev[k] for k in ("held_out_reward_turn1", "turns_mean") if k in ev},
                            **{f"held_out_reward/{k}": v for k, v in ev["per_family"].items()}})

    def _schedule(self) -> dict[str, Any]:
        """How the final policy was trained: the RL phase's learning rate, from its peak to its last value
        (the final figures are those of the policy after the last step, not the best evaluated one)."""
        from stalwart.train.optim import LRSchedule

        cfg = self.cfg
        total = cfg.rl.steps * cfg.rl.updates_per_step
        last = LRSchedule(cfg.scheduler, cfg.optimizer.lr, total).factor(total - 1) * cfg.optimizer.lr
        return {**dataclasses.asdict(cfg.scheduler), "peak_lr": cfg.optimizer.lr, "final_lr": last,
                "optimizer_steps": total, "final_policy": "the last step's"}

    def _summary(self, sft_fig: dict, start: dict, final: dict, curve: dict) -> dict[str, Any]:
        svc = self.svc
        summary = {"kind": "rl", "mode": self.cfg.rl.mode, "steps": self.cfg.rl.steps,
                   "initial_reward_mean": start["held_out_reward"], "final_reward_mean": final["held_out_reward"],
                   "final_per_family": final["per_family"], "initial_per_family": start["per_family"],
                   "final_examples": final["examples"],
                   "held_out_instances": final["held_out_instances"], "sft": sft_fig,
                   "replacements": {"generator": svc.generators.pool.replacements,
                                    "reward": svc.rewards.pool.replacements,
                                    "trainer": curve.get("trainer_recoveries", 0)},
                   "wall_s": time.time() - self.t0, "resumed": self.resumed, "lr_schedule": self._schedule(),
                   # the controller's own peak memory: it holds no weights, so this does not grow with the model
                   "controller_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   **{k: v for k, v in curve.items() if k != "trainer_recoveries"}}
        self.paths.summary.write_text(json.dumps(summary, indent=1))
        return summary


def run_rl_job(cfg: RLConfig) -> int:
    from stalwart.ft.runlock import RunLock
    from stalwart.runtime.device import check_device

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    paths = RunPaths.of(cfg.run)
    TaskSetup.of(cfg)  # a mistake in the task section is refused before the run directory is touched
    # and a device this machine lacks, before any actor (a generator's processes need a GPU each)
    check_device(cfg.workers.device, cfg.workers.generator_tp, "--device")
    if paths.summary.exists():  # a killed run (no summary) is resumed by the same command instead
        shutil.rmtree(paths.snapshots(), ignore_errors=True)  # left if it was killed between its summary and exit
        raise UserError(f"run.dir {paths.root} already holds a run that finished; pass another --run.dir or "
                        "remove that one")
    with RunLock(paths):
        try:
            s = RLDriver(cfg).run()
        except ActorsFailed as e:
            print(f"stalwart rl: {e}", flush=True)
            return 75
        except RecoveriesExhausted as e:
            print(f"stalwart rl: {e}", flush=True)
            return e.exit_code
        except ReplayDiverged as e:  # a resumed step did not reproduce the journal: determinism is broken
            print(f"stalwart rl: {e}", flush=True)
            return 1
    print(f"stalwart rl: held-out reward {s['initial_reward_mean']:.3f} after fine-tuning -> "
          f"{s['final_reward_mean']:.3f} after {s['steps']} RL steps ({s['wall_s']:.0f} s); "
          f"summary in {RunPaths.of(cfg.run).summary}", flush=True)
    return 0
