"""The phases of an RL run on its services: warm-up fine-tuning, then the GRPO steps (sync or async),
with the trainer mesh's recovery through the journal.

Per step ``s``: the groups of ``plan_step(s)`` come back from the generators (issued ``ahead`` steps
early in async mode, so they were generated while earlier steps trained), any group staler than
``rl.max_offpolicy_steps`` is generated again with the current weights, every program is scored, the
advantages are computed per group, each trainer rank gets whole groups (one group is one micro-batch:
the shape the generators re-score with), and the trainers send the new weights to the generators as
version ``s`` (``rl/weights.py``).

The loop receives its services (:class:`Services`) and the run's outputs (:class:`RunContext`); it
reaches into no driver.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stalwart.controller.mesh import ActorsFailed
from stalwart.controller.replay import Recovery, RecoveryRole, Restored
from stalwart.rl import rollout, routing
from stalwart.rl.balance import Layout, decide
from stalwart.rl.dynamic import refill
from stalwart.rl.grpo import group_advantages
from stalwart.rl.services import Generators, Rewards, Trainers
from stalwart.rl.setup import sft_rows
from stalwart.rl.weights import Sync, TrainersFailed, WeightSync


@dataclass
class Services:
    trainers: Trainers
    generators: Generators
    rewards: Rewards
    weights: WeightSync


@dataclass
class RunContext:
    """What the loop needs from the run: its config, the task and row shapes, where records go, and
    the held-out evaluation."""
    cfg: Any                      # RLConfig
    task: Any                     # rl.setup.TaskSetup
    args: Any                     # the policy's TransformerArgs
    length: int                   # packed row length
    pad: int
    journal: Any                  # controller.journal.Journal
    metrics: Any                  # JsonlWriter
    events: Callable[..., None]
    progress: Any                 # rl.progress.RLProgress
    evaluate: Callable[[str], dict[str, Any]]
    record_eval: Callable[[int, dict[str, Any]], None]
    rebalance_dir: str
    store: Any                    # the controller's store (the trainers' group attempts meet on it)
    t0: float
    keep_state: Callable[[int, Any], None]        # the loop's state of a step, before the trainers' snapshot
    check: Callable[[int, dict, dict], None]      # a step an earlier session completed: checked again


def sft(run: RunContext, svc: Services, tok: Any, eos: int) -> dict[str, Any]:
    """Supervised warm-up on the trainer mesh: full-batch steps on the fine-tuning examples."""
    cfg = run.cfg
    n = svc.trainers.dp  # data-parallel ranks, each with its share of the examples
    t0 = time.time()
    loss = None
    if run.task.sft and cfg.sft.steps:
        r = cfg.rl  # one prompt and one program: the rows of a one-turn episode, however many turns RL has
        length = run.length - (r.turns - 1) * (r.max_tokens + r.feedback_tokens)
        svc.trainers.build("sft", run.args, length, 1, cfg.sft.steps)
        rows = sft_rows(tok, eos, run.task.sft, length, run.pad, n)
        for s in range(1, cfg.sft.steps + 1):
            rec = svc.trainers.train(s, [[[rows[r]]] for r in range(n)])
            loss = rec["loss"]
            run.metrics.write({"step": s, "kind": "sft", "loss": loss, "grad_norm": rec["grad_norm"],
                               "elapsed_s": time.time() - run.t0})
            run.progress.sft(s, cfg.sft.steps, loss)
    info = svc.trainers.build("rl", run.args, run.length, cfg.rl.prompts_per_step // n, cfg.rl.steps)
    run.events("rl_trainers", layout=info["layout"], params=info["params"], sft_examples=len(run.task.sft))
    return {"examples": len(run.task.sft), "steps": cfg.sft.steps, "final_loss": loss, "seconds": time.time() - t0}


class Stepper:
    """The RL steps of one run."""

    def __init__(self, run: RunContext, svc: Services) -> None:
        self.ctx, self.svc = run, svc
        r = run.cfg.rl
        self.r = r
        self.ahead = r.max_offpolicy_steps if r.mode == "async" else 0
        self.inflight: dict[int, Any] = {}
        self.ready: dict[int, tuple[list[rollout.Group], dict[str, float]]] = {}  # generated before a rebalance
        self.busy: list[tuple[float, float]] = []  # per step: generator and trainer worker-seconds
        self.syncs: list[Sync] = []                # weight syncs sent and not yet settled (async)
        self.snap_step = 0
        self.trained: dict[str, int] = {}          # gid -> the step that trained it
        self.kept: dict[int, list] = {}            # step -> the trainer rows, since the snapshot
        self.staleness_max = 0
        self.first = 0                             # the step this session starts after (rl/state.py resumes)
        self.groups_before = 0                     # groups trained by earlier sessions
        self.steps_to: dict[str, float] = {}
        tr, c = svc.trainers, run.cfg.controller
        role = RecoveryRole(attempt=lambda: tr.attempt, rebuild=self._rebuild, restore=self._restore,
                            replay=lambda t: tr.train(t, self.kept[t]), matched=("loss", "grad_norm"))
        self.recovery = Recovery(tr.mesh, run.store, run.journal, role, run.events, max_recoveries=c.max_recoveries,
                                 settle_s=c.step_timeout_s + 2.0, engine="rl_trainer")

    def plan(self, s: int) -> list[rollout.GroupRequest]:
        return rollout.plan_step(s, self.ctx.cfg.run.seed, self.ctx.task.train, self.r.prompts_per_step,
                                 self.r.group_size)

    # ------------------------------------------------------------------ weights
    def settle_syncs(self) -> dict[str, float]:
        """Wait for the weight syncs sent (they follow the generations issued before them)."""
        fig: dict[str, float] = {}
        while self.syncs:
            sync = self.syncs[0]
            try:
                fig = self.svc.weights.settle(sync)
            except TrainersFailed as e:  # a trainer failed while sending: recover (the trainers replay every
                self.recover(e, sync.version)  # step the journal holds), then send what they hold now
                self.syncs[0] = self._send_current()
                continue
            self.recovery.step_done(sync.version)
            self.syncs.pop(0)
        return fig

    def _send_current(self) -> Sync:
        """Start sending the trainers' current weights to every generator (the trainers recovered first
        if one fails while the links are joined)."""
        while True:
            try:
                return self.svc.weights.publish(self.svc.trainers.version)
            except TrainersFailed as e:
                self.recover(e, self.svc.trainers.version + 1)

    def publish(self, s: int) -> dict[str, float]:
        """The trainers' weights of step ``s`` go to the generators as version ``s``: at once in sync mode,
        queued behind the generations already sent in async mode."""
        self.settle_syncs()  # the previous version's sync (done by now, normally)
        self.syncs.append(self._send_current())
        return {} if self.ahead else self.settle_syncs()

    def catch_up(self, s: int) -> None:
        """Before generating with the current weights (a regeneration, an evaluation): the syncs sent are
        settled and every generator holds the trainers' weights (a newcomer that missed them gets them)."""
        while True:
            self.settle_syncs()
            try:
                self.svc.weights.catch_up()
                return
            except TrainersFailed as e:
                self.recover(e, s)

    # ------------------------------------------------------------------ one step
    def groups_for(self, s: int) -> tuple[list[rollout.Group], dict[str, float]]:
        gen = self.svc.generators
        if s in self.ready:
            groups, fig = self.ready.pop(s)
        else:
            groups, fig = gen.collect(self.inflight.pop(s, None) or gen.generate(self.plan(s)))
        stale = [g for g in groups if not rollout.admissible(g.version, s, self.ahead)]
        fig["regenerated_groups"] = 0
        while stale:  # too old (or, impossible by construction, newer than the trainer): generate again
            self.catch_up(s)
            again, more = gen.run([g.request for g in stale])
            fig["regenerated_groups"] += len(again)
            fig["gen_s"] += more["gen_s"]
            fig["rollout_tokens"] += more["rollout_tokens"]
            fresh = {g.gid: g for g in again}
            groups = [fresh.get(g.gid, g) for g in groups]
            stale = [g for g in groups if not rollout.admissible(g.version, s, self.ahead)]
        return groups, fig

    def pack(self, s: int, groups: list[rollout.Group]) -> list[list[list[tuple[np.ndarray, np.ndarray]]]]:
        """Per data-parallel trainer rank, per update (``rl.updates_per_step`` mini-batches of whole groups), the packed
        micro-batches (one group each); each update's weights make its own aggregate."""
        r, run = self.r, self.ctx
        n = self.svc.trainers.dp
        adv = group_advantages([g.rewards for g in groups], r.algorithm, r.scale_advantages)
        u = r.updates_per_step
        per_rank: list[list[list]] = [[[] for _ in range(u)] for _ in range(n)]
        size = len(groups) // u
        for j in range(u):
            part = range(j * size, (j + 1) * size)
            weight = rollout.aggregation_weights([groups[i] for i in part], r.aggregation, n, size // n,
                                                 r.max_tokens * r.turns)
            for i in part:
                packed = rollout.pack_group(groups[i], adv[i], run.length, run.pad, weight, s - 1, r.kl_coef > 0)
                if groups[i].routing is not None:  # routing replay: the generator's experts ride along
                    packed = (*packed, routing.pack(groups[i].routing, run.length))
                per_rank[i % n][j].append(packed)
        return per_rank

    def step(self, s: int) -> dict[str, Any]:
        """RL step ``s``: generate (or collect), score, train, publish; its metrics record."""
        svc, r, run = self.svc, self.r, self.ctx
        gen, rew = svc.generators, svc.rewards
        t0 = time.perf_counter()
        busy0 = (sum(gen.pool.busy_s), sum(rew.pool.busy_s))
        for t in range(s + 1, min(s + self.ahead, r.steps) + 1):  # the generators run ahead meanwhile
            if t not in self.inflight and t not in self.ready:
                self.inflight[t] = gen.generate(self.plan(t))
        groups, gfig = self.groups_for(s)
        sfig = rew.score(groups)
        sampled, dfig = groups, {}
        if r.dynamic_sampling:
            groups, sampled, dfig = refill(self, s, groups, gfig, sfig)
        per_rank = self.pack(s, groups)
        stale = [rollout.staleness(g.version, s) for g in groups]
        self.staleness_max = max(self.staleness_max, max(stale))
        run.journal.append("step", step=s, groups=[g.gid for g in groups], versions=[g.version for g in groups])
        rec = self._train_recovering(s, per_rank)
        for g in groups:
            if g.gid in self.trained:
                raise RuntimeError(f"group {g.gid} would be trained twice (steps {self.trained[g.gid]} and {s})")
            self.trained[g.gid] = s
        self.kept[s] = per_rank
        applied = run.journal.append("applied", sync=False, step=s, loss=rec["loss"], grad_norm=rec["grad_norm"])
        run.check(s, {"groups": [g.gid for g in groups], "versions": [g.version for g in groups]}, applied)
        t_sync = time.perf_counter()
        wfig = self.publish(s)
        sync_s = time.perf_counter() - t_sync
        send_s = wfig.get("weight_send_s", 0.0)
        trainer_busy = rec["trainer_s"] + send_s
        self.busy.append((sum(gen.pool.busy_s) - busy0[0], trainer_busy * svc.trainers.n))
        wall = time.perf_counter() - t0
        rewards = [x for g in sampled for x in g.rewards]
        gen_busy = sum(gen.pool.busy_s) - busy0[0]
        rew_busy = sum(rew.pool.busy_s) - busy0[1]
        return {"step": s, "kind": "rl", "reward_mean": float(np.mean(rewards)), "reward_std": float(np.std(rewards)),
                "solved_groups": sum(1 for g in groups if max(g.rewards) == 1.0),
                "loss": rec["loss"], "grad_norm": rec["grad_norm"], "lr": rec["lr"],
                **{k: rec[k] for k in ("kl", "clip_fraction", "entropy", "logprob_mismatch_mean",
                                       "logprob_mismatch_max", "ratio_max", "policy_loss", "train_tokens")},
                **{k: rec[k] for k in ("routing_replayed", "routing_flip_frac", "routing_unrecorded", "routing_layers")
                   if k in rec},
                "staleness_mean": float(np.mean(stale)), "staleness_max": max(stale),
                "weight_version": s, **gfig, **sfig,
                "rollout_tokens_per_s": gfig["rollout_tokens"] / max(gfig["gen_s"], 1e-9),
                "trainer_tokens_per_s": rec["train_tokens"] / max(rec["trainer_s"], 1e-9),
                "train_s": rec["trainer_s"], "weight_sync_s": sync_s, "weight_send_s": send_s,
                "weight_recv_s": wfig.get("weight_recv_s", 0.0),
                "step_s": wall, "elapsed_s": time.time() - run.t0,
                "generator_idle_frac": max(0.0, 1 - gen_busy / (wall * gen.n)),
                "reward_idle_frac": max(0.0, 1 - rew_busy / (wall * rew.n)),
                "trainer_idle_frac": max(0.0, 1 - trainer_busy / wall),
                "generators": gen.n, "trainers": svc.trainers.n, **dfig,
                **{k: rec[k] for k in ("exact_score_s",) if k in rec}}

    def run(self) -> dict[str, Any]:
        r, run = self.r, self.ctx
        if self.first == 0:
            self.take_snapshot(0)
        run.progress.start(self.first)
        for s in range(self.first + 1, r.steps + 1):
            record = self.step(s)
            run.metrics.write(record)
            run.progress.step(record)
            if s % r.eval_interval == 0 and s != r.steps:
                self.evaluate(s)
            self.persist(s)
            self.maybe_rebalance(s)
        self.catch_up(r.steps + 1)  # the final evaluation follows
        run.progress.close()
        return {"trainer_recoveries": self.recovery.count, "staleness_max": self.staleness_max,
                "groups_trained": self.groups_before + len(self.trained), **self.steps_to}

    def evaluate(self, s: int) -> None:
        """The held-out evaluation after step ``s`` (the generators hold the weights of step ``s``)."""
        run = self.ctx
        self.catch_up(s + 1)
        run.progress.phase(f"evaluating the held-out instances after step {s}")
        ev = run.evaluate(f"step-{s}")
        run.record_eval(s, ev)
        run.progress.phase(f"held-out reward {ev['held_out_reward']:.3f} after step {s}")
        if ev["held_out_reward"] >= 0.8:
            self.steps_to.setdefault("steps_to_0.8", s)
            self.steps_to.setdefault("minutes_to_0.8", (time.time() - run.t0) / 60)

    def persist(self, s: int) -> None:
        """What a rerun resumes from, once step ``s`` is done (its metrics row and its evaluation written):
        every ``workers.snapshot_interval`` steps the trainers' in-memory snapshot, every
        ``workers.checkpoint_interval`` steps their disk checkpoint (each on its own schedule), each after
        the loop's state of ``s``. A controller killed before that (in an evaluation, say) resumes from
        an earlier state and computes step ``s`` and its evaluation again."""
        w = self.ctx.cfg.workers
        memory = s % w.snapshot_interval == 0
        if memory or (w.checkpoint_interval and s % w.checkpoint_interval == 0):
            self.take_snapshot(s, memory)

    # ------------------------------------------------------------------ balancing
    def maybe_rebalance(self, s: int) -> None:
        r, w, svc = self.r, self.ctx.cfg.workers, self.svc
        if w.balance != "adaptive" or s % w.balance_window or s >= r.steps:
            return
        recent = self.busy[-w.balance_window:]
        gen_b, train_b = (sum(b[i] for b in recent) / len(recent) for i in (0, 1))
        move = decide(gen_b, train_b, Layout(svc.generators.n, svc.trainers.n),
                      r.prompts_per_step // r.updates_per_step, w.balance_min_gain)
        self.ctx.events("rl_balance", step=s, generator_busy_s=gen_b, trainer_busy_s=train_b,
                         generators=svc.generators.n, trainers=svc.trainers.n,
                         move=None if move is None else [move.to.generators, move.to.trainers])
        if move is not None:
            self.rebalance(s, move)

    def rebalance(self, s: int, move) -> None:
        """Move workers between the generator and trainer meshes after step ``s``: the generations already
        sent are collected first; the trainers' state crosses the change of their count through a
        checkpoint on disk (each rank writes its shards, each new rank reads its own); new generators get
        the weights of step ``s`` from the new trainers."""
        svc, run = self.svc, self.ctx
        t0 = time.perf_counter()
        before = (svc.generators.n, svc.trainers.n)
        for t in sorted(self.inflight):
            self.ready[t] = svc.generators.collect(self.inflight.pop(t))
        self.settle_syncs()
        path = svc.trainers.save_checkpoint(run.rebalance_dir)
        tm = svc.trainers.mesh
        while tm.n > move.to.trainers:
            tm.shrink()
        while tm.n < move.to.trainers:
            tm.grow()
        svc.trainers.warm()
        self._regroup_trainers()
        svc.trainers.load_checkpoint(path)
        self.take_snapshot(s)  # the new layout's own snapshot (the old one no longer fits it)
        while svc.generators.n > move.to.generators:
            svc.generators.pool.shrink()
            svc.weights.forget(svc.generators.n)
        while svc.generators.n < move.to.generators:
            svc.generators.pool.grow()  # set up and brought to version s
        run.events("rl_rebalance", step=s, generators=[before[0], svc.generators.n],
                   trainers=[before[1], svc.trainers.n], reason=move.reason, seconds=time.perf_counter() - t0,
                   pids={"generators": dict(svc.generators.mesh.pids), "trainers": dict(svc.trainers.pids)})

    # ------------------------------------------------------------------ trainer recovery
    def _regroup_trainers(self) -> None:
        """Every trainer joins a new group (of the mesh's size) and builds its RL core."""
        cfg, tr = self.ctx.cfg, self.svc.trainers
        tr.regroup()
        tr.build("rl", self.ctx.args, self.ctx.length, cfg.rl.prompts_per_step // tr.dp, cfg.rl.steps)

    def take_snapshot(self, s: int, memory: bool = True) -> None:
        """The loop's own state of step ``s`` (its pending groups collected first; with it the trainers'
        disk checkpoint when one is due, ``RunContext.keep_state``), then, with ``memory``, the trainers'
        snapshot of it: every snapshot and checkpoint that exists has its loop state (``rl/state.py``)."""
        for t in sorted(self.inflight):
            self.ready[t] = self.svc.generators.collect(self.inflight.pop(t))
        self.ctx.keep_state(s, self)
        if not memory:
            return
        self.svc.trainers.snapshot(s)
        self.kept = {k: v for k, v in self.kept.items() if k > s}
        self.snap_step = s
        self.ctx.journal.append("snapshot", sync=False, step=s)

    def _train_recovering(self, s: int, per_rank) -> dict[str, Any]:
        while True:
            try:
                rec = self.svc.trainers.train(s, per_rank)
            except ActorsFailed as e:
                self.recover(e, s)
                continue
            self.recovery.step_done(s)
            return rec

    def recover(self, err: ActorsFailed, s: int) -> None:
        """The failed trainers are replaced, every trainer restores its snapshot (a replacement takes its
        shard from the snapshot's own or peer copy) and the journaled steps since are replayed and checked
        (``controller.replay.Recovery``); the caller then retries what failed."""
        self.ctx.progress.phase(f"trainer(s) {sorted({f.rank for f in err.failures})} failed at step {s}: "
                                 f"replacing them, replaying from the snapshot of step {self.snap_step}")
        self.recovery.recover(err, s)

    def _rebuild(self) -> None:
        self.svc.trainers.warm()
        self._regroup_trainers()

    def _restore(self) -> Restored:
        step = self.svc.trainers.restore()
        return Restored(step, "snapshot", {"snapshot_step": step, "pids": dict(self.svc.trainers.pids)})
