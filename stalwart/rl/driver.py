"""``stalwart rl``: one controller program drives three actor meshes through the single-controller API
(``stalwart.controller.mesh``): generators (the inference engine with versioned weight updates),
trainers (the training core under the configured parallel layout) and reward workers (the sandbox).

A run: train a tokenizer on the training instances; warm the policy up by supervised fine-tuning on a
few examples (on the trainer mesh); install the weights on the generators as version 0; then per RL
step: generate the step's groups, score them, compute group-relative advantages, train one optimizer
step, and install the new weights as the next version. In ``async`` mode the generators work on the
next steps' groups while the trainers train (at most ``rl.max_offpolicy_steps`` versions stale; a
staler group is generated again). Held-out instances are evaluated at the start, every
``rl.eval_interval`` steps and at the end.

The controller journals every step (the groups it trains on, their versions, the applied result) in
``controller/journal.jsonl`` and keeps a full trainer snapshot every ``workers.snapshot_interval``
steps: a trainer that fails is replaced, every trainer restores the snapshot, and the steps since are
replayed from the batches the controller kept; a replayed step must reproduce its journaled loss.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from datetime import timedelta
from typing import Any

import numpy as np

from stalwart.config.render import to_toml
from stalwart.config.rl import RLConfig
from stalwart.errors import UserError
from stalwart.controller.journal import Journal
from stalwart.controller.mesh import ActorMesh, ActorsFailed, configure_monarch
from stalwart.metrics.records import EventLog, JsonlWriter
from stalwart.paths import RunPaths
from stalwart.rl import rollout
from stalwart.rl.pools import Pool, deal
from stalwart.rl.setup import (
    TaskSetup,
    build_tokenizer,
    max_prompt_tokens,
    prompt_text,
)

SETUP_S = 600.0


class RLDriver:
    def __init__(self, cfg: RLConfig) -> None:
        import torch.distributed as dist

        run = dataclasses.replace(cfg.run, dir=str(RunPaths.of(cfg.run).root.resolve()))
        self.cfg = cfg = dataclasses.replace(cfg, run=run)
        self.paths = RunPaths.of(cfg.run)
        self.task = TaskSetup.of(cfg)
        self.paths.root.mkdir(parents=True, exist_ok=True)
        self.paths.config.write_text(to_toml(cfg))
        self.events = EventLog(self.paths.events)
        self.metrics = JsonlWriter(self.paths.metrics)
        self.tok = build_tokenizer(self.task, cfg.task.vocab_size)
        self.paths.tokenizer.write_text(self.tok.to_str(pretty=True))
        from stalwart.data.tokenizer import eos_id
        from stalwart.models.flavors import resolve_args

        self.eos = eos_id(self.tok)
        self.pad = self.eos
        self.prompt_len = max_prompt_tokens(self.tok, self.task.train + self.task.evaluated)
        self.length = rollout.row_length(self.prompt_len, cfg.rl.max_tokens)
        self.args = resolve_args(cfg.model, self.tok.get_vocab_size(), self.length + 1)
        used = self.task.train + self.task.evaluated
        self.prompts = {i.key: self.tok.encode(prompt_text(i)).ids for i in used}
        self.cases = {i.key: [(c.input, c.output) for c in i.cases(cfg.task.tests, cfg.run.seed)] for i in used}
        self.store = dist.TCPStore("127.0.0.1", 0, cfg.workers.trainers, True, timeout=timedelta(seconds=SETUP_S),
                                   wait_for_workers=False)
        self.attempt = 0
        self.version = 0
        self.weights: dict[str, np.ndarray] = {}
        self.reference: dict[str, np.ndarray] | None = None
        self.verdicts: dict[tuple[str, str], tuple] = {}  # (instance, program) -> verdict: a program is run once
        self.trained: dict[str, int] = {}                 # gid -> the step that trained it
        self.kept: dict[int, list] = {}                   # step -> the trainer rows, since the snapshot
        self.snapshot: dict[str, Any] | None = None
        self.journal: Journal | None = None
        self.t0 = time.time()

    # ------------------------------------------------------------------ meshes
    def _spawn(self) -> None:
        from stalwart.rl.generator import GeneratorActor
        from stalwart.rl.reward import RewardActor
        from stalwart.rl.trainer import PolicyTrainerActor

        w, spares = self.cfg.workers, self.cfg.controller.spares
        poll = self.cfg.controller.supervision_poll_s
        self.trainers = ActorMesh.spawn(PolicyTrainerActor, "trainer", w.trainers, spares)
        gens = ActorMesh.spawn(GeneratorActor, "generator", w.generators, spares)
        rewards = ActorMesh.spawn(RewardActor, "reward", w.reward_workers, spares)
        for mesh in (self.trainers, gens, rewards):
            mesh.report_grace_s = poll + 0.25
            for r, pid in mesh.call_all(mesh.actor_cls.warm, (), SETUP_S).items():
                mesh.pids[r] = pid
        self.gen = Pool(gens, "generator", w.generate_timeout_s, self.events, self._restore_generator)
        self.rew = Pool(rewards, "reward", w.reward_timeout_s, self.events, self._restore_reward)
        self.events("rl_meshes", trainers=dict(self.trainers.pids), generators=dict(gens.pids),
                    rewards=dict(rewards.pids))

    def _gen_setup_args(self) -> tuple:
        r = self.cfg.rl
        sampling = {"max_tokens": r.max_tokens, "temperature": r.temperature, "top_k": r.top_k}
        return (self.args, self.tok.to_str(), self.cfg.engine, sampling, r.logprobs == "exact", self.length, self.pad)

    def _restore_generator(self, rank: int) -> None:
        from stalwart.rl.generator import GeneratorActor  # Monarch: imported after configure_monarch

        m = self.gen.mesh
        m.wait(m.call(GeneratorActor.setup, self._gen_setup_args(), ranks=[rank]), SETUP_S, "generator setup")
        if self.reference is not None:
            m.wait(m.call(GeneratorActor.load, (self.reference, 0, True), ranks=[rank]), SETUP_S, "generator load")
        m.wait(m.call(GeneratorActor.load, (self.weights, self.version, False), ranks=[rank]), SETUP_S,
               "generator load")

    def _restore_reward(self, rank: int) -> None:
        from stalwart.rl.reward import RewardActor

        m = self.rew.mesh
        m.wait(m.call(RewardActor.setup, (self.cfg.sandbox, self.cfg.workers.reward_threads), ranks=[rank]), SETUP_S,
               "reward setup")

    def _join_trainers(self) -> None:
        from stalwart.rl.trainer import PolicyTrainerActor

        n = self.cfg.workers.trainers
        timeout = self.cfg.controller.step_timeout_s
        replies = self.trainers.call_all(PolicyTrainerActor.join, lambda r: (self.cfg, r, n, self.store.port,
                                                                              self.attempt, timeout, SETUP_S), SETUP_S)
        for r, rep in replies.items():
            self.trainers.pids[r] = rep["pid"]

    def resize_trainers(self, n: int) -> None:
        """Every trainer (``n`` of them) joins a new process group and rebuilds its RL core."""
        self.cfg = dataclasses.replace(self.cfg, workers=dataclasses.replace(self.cfg.workers, trainers=n))
        self.attempt += 1
        self._join_trainers()
        self._build_trainers("rl", self.cfg.rl.prompts_per_step // n, self.cfg.rl.steps)

    def _build_trainers(self, phase: str, micro_per_rank: int, steps: int) -> dict:
        from stalwart.rl.trainer import PolicyTrainerActor

        return self.trainers.call_all(PolicyTrainerActor.build, (phase, self.args, self.length, micro_per_rank, steps),
                                      SETUP_S)[0]

    # ------------------------------------------------------------------ weights
    def _pull_weights(self) -> float:
        from stalwart.rl.trainer import PolicyTrainerActor

        t0 = time.perf_counter()
        reply = self.trainers.call_all(PolicyTrainerActor.weights, (), self.cfg.controller.step_timeout_s)
        self.weights = reply[0]["weights"]
        return time.perf_counter() - t0

    def _push_weights(self, version: int, pending: bool = False):
        """Install the held weights as ``version`` on every generator (queued behind their work when
        ``pending``: the futures are returned, to be collected later)."""
        from stalwart.rl.generator import GeneratorActor

        self.version = version
        if pending:
            return self.gen.send(GeneratorActor.load, {r: None for r in range(self.gen.n)},
                                 lambda _: (self.weights, version, False))
        self.gen.call_all(GeneratorActor.load, (self.weights, version, False))
        return None

    # ------------------------------------------------------------------ generation and scoring
    def _send_generate(self, requests: list[rollout.GroupRequest]):
        from stalwart.rl.generator import GeneratorActor

        pieces = deal(requests, self.gen.n)
        return self.gen.send(GeneratorActor.generate, pieces,
                             lambda reqs: (reqs, [self.prompts[q.instance.key] for q in reqs]))

    def _collect_generate(self, pending) -> tuple[list[rollout.Group], dict[str, float]]:
        replies = self.gen.collect(pending)
        groups = sorted((g for rep in replies.values() for g in rep["groups"]), key=lambda g: g.request.index)
        for r, rep in replies.items():
            self.gen.busy_s[r] += rep["gen_s"] + rep["rescore_s"]
        fig = {"gen_s": max(rep["gen_s"] for rep in replies.values()),
               "rescore_s": max(rep["rescore_s"] for rep in replies.values()),
               "rollout_tokens": sum(rep["tokens"] for rep in replies.values())}
        return groups, fig

    def _program(self, response: list[int]) -> str:
        ids = response[:-1] if response and response[-1] == self.eos else response
        return self.tok.decode(ids)

    def _score(self, groups: list[rollout.Group]) -> dict[str, float]:
        """Every response's reward; a program already run for that instance is not run again."""
        from stalwart.rl.reward import RewardActor

        t0 = time.perf_counter()
        jobs = []
        for g in groups:
            key = g.request.instance.key
            for resp in g.responses:
                prog = self._program(resp)
                if (key, prog) not in self.verdicts and (key, prog) not in jobs:
                    jobs.append((key, prog))
        busy = 0.0
        if jobs:
            pending = self.rew.send(RewardActor.score, deal(jobs, self.rew.n),
                                    lambda chunk: ([(prog, self.cases[key]) for key, prog in chunk],))
            pieces = {r: chunk for r, (_, (chunk, _)) in pending.pieces.items()}
            for r, rep in self.rew.collect(pending).items():
                self.rew.busy_s[r] += rep["seconds"]
                busy = max(busy, rep["seconds"])
                for job, verdict in zip(pieces[r], rep["verdicts"]):
                    self.verdicts[job] = tuple(verdict)
        for g in groups:
            key = g.request.instance.key
            vs = [self.verdicts[(key, self._program(resp))] for resp in g.responses]
            g.rewards = [v[0] for v in vs]
            g.verdicts = [v[3] for v in vs]
        return {"score_s": time.perf_counter() - t0, "programs_run": len(jobs)}

    def evaluate(self, tag: str) -> dict[str, Any]:
        reqs = rollout.eval_plan(self.cfg.run.seed, self.task.evaluated, self.cfg.rl.eval_samples, tag)
        groups, _ = self._collect_generate(self._send_generate(reqs))
        self._score(groups)
        fam: dict[str, list[float]] = {}
        examples: dict[str, dict[str, Any]] = {}
        for g in groups:
            inst = g.request.instance
            fam.setdefault(inst.family, []).extend(g.rewards)
            if inst.family not in examples:  # one response per family, to read what the policy writes
                examples[inst.family] = {"prompt": inst.prompt, "program": self._program(g.responses[0]),
                                         "reward": g.rewards[0], "verdict": g.verdicts[0]}
        allr = [x for g in groups for x in g.rewards]
        return {"held_out_reward": float(np.mean(allr)), "per_family": {k: float(np.mean(v)) for k, v in sorted(fam.items())},
                "held_out_instances": len(groups), "examples": examples}

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        configure_monarch(self.cfg.controller.supervision_poll_s)
        self.events("launch", engine="rl-controller", mode=self.cfg.rl.mode)
        try:
            self._spawn()
            return self._run()
        finally:
            meshes = [getattr(self, "trainers", None)] + [p.mesh for p in (getattr(self, "gen", None),
                                                                          getattr(self, "rew", None)) if p]
            for mesh in meshes:
                if mesh is not None:
                    mesh.stop()
            if self.journal is not None:
                self.journal.close()
            self.metrics.close()
            self.events("supervisor_exit", engine="rl-controller")
            self.events.close()

    def _run(self) -> dict[str, Any]:
        from stalwart.rl.generator import GeneratorActor
        from stalwart.rl.loop import run_rl, sft
        from stalwart.rl.reward import RewardActor

        cfg = self.cfg
        self.journal = Journal(self.paths.journal)
        self._join_trainers()
        self.gen.call_all(GeneratorActor.setup, self._gen_setup_args())
        self.rew.call_all(RewardActor.setup, (cfg.sandbox, cfg.workers.reward_threads))
        sft_fig = sft(self)
        self._pull_weights()
        if cfg.rl.kl_coef > 0:
            self.reference = self.weights
            self.gen.call_all(GeneratorActor.load, (self.reference, 0, True))
        self._push_weights(0)
        start = self.evaluate("start")
        self._eval_record(0, start)
        self.events("rl_start", held_out_reward=start["held_out_reward"], train_instances=len(self.task.train),
                    held_out_instances=len(self.task.held_out),
                    evaluated_instances=len(self.task.evaluated), sft_examples=len(self.task.sft), mode=cfg.rl.mode)
        curve = run_rl(self)
        final = self.evaluate("final")
        self._eval_record(cfg.rl.steps, final)
        curve["policy"] = self._save_policy()
        return self._summary(sft_fig, start, final, curve)

    def _save_policy(self) -> str:
        """The trained policy as a run directory of its own: a training config that names its model
        shape, the tokenizer, and a checkpoint the trainers write in Stalwart's checkpoint format."""
        from stalwart.config.job import DataConfig, JobConfig, RunConfig
        from stalwart.rl.trainer import PolicyTrainerActor

        out = RunPaths(self.paths.policy)
        out.root.mkdir(parents=True, exist_ok=True)
        job = JobConfig(run=RunConfig(name=f"{self.cfg.run.name}-policy", dir=str(out.root), seed=self.cfg.run.seed),
                        model=self.cfg.model, data=DataConfig(seq_len=self.length + 1))
        out.config.write_text(to_toml(job))
        out.tokenizer.write_text(self.tok.to_str(pretty=True))
        return self.trainers.call_all(PolicyTrainerActor.save_policy, (str(out.checkpoints),), SETUP_S)[0]

    def _eval_record(self, step: int, ev: dict[str, Any]) -> None:
        self.metrics.write({"step": step, "kind": "eval", "held_out_reward": ev["held_out_reward"],
                            "elapsed_s": time.time() - self.t0,
                            **{f"held_out_reward/{k}": v for k, v in ev["per_family"].items()}})

    def _summary(self, sft_fig: dict, start: dict, final: dict, curve: dict) -> dict[str, Any]:
        summary = {"kind": "rl", "mode": self.cfg.rl.mode, "steps": self.cfg.rl.steps,
                   "initial_reward_mean": start["held_out_reward"], "final_reward_mean": final["held_out_reward"],
                   "final_per_family": final["per_family"], "initial_per_family": start["per_family"],
                   "final_examples": final["examples"],
                   "held_out_instances": final["held_out_instances"], "sft": sft_fig,
                   "replacements": {"generator": self.gen.replacements, "reward": self.rew.replacements,
                                    "trainer": curve.get("trainer_recoveries", 0)},
                   "wall_s": time.time() - self.t0, **{k: v for k, v in curve.items() if k != "trainer_recoveries"}}
        self.paths.summary.write_text(json.dumps(summary, indent=1))
        return summary


def run_rl_job(cfg: RLConfig) -> int:
    from stalwart.ft.runlock import RunLock

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    paths = RunPaths.of(cfg.run)
    TaskSetup.of(cfg)  # a mistake in the task section is refused before the run directory is touched
    if paths.metrics.exists() or paths.summary.exists():
        raise UserError(f"run.dir {paths.root} already holds a run (an RL run does not resume); pass another "
                        "--run.dir or remove that one")
    with RunLock(paths):
        try:
            s = RLDriver(cfg).run()
        except ActorsFailed as e:
            print(f"stalwart rl: {e}", flush=True)
            return 75
    print(f"stalwart rl: held-out reward {s['initial_reward_mean']:.3f} after fine-tuning -> "
          f"{s['final_reward_mean']:.3f} after {s['steps']} RL steps ({s['wall_s']:.0f} s); "
          f"summary in {RunPaths.of(cfg.run).summary}", flush=True)
    return 0
