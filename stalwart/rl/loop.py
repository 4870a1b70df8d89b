"""The phases of an RL run on the driver's meshes: warm-up fine-tuning, then the GRPO steps (sync or
async), with the trainer mesh's recovery through the journal.

Per step ``s``: the groups of ``plan_step(s)`` come back from the generators (issued ``ahead`` steps
early in async mode, so they were generated while earlier steps trained), any group staler than
``rl.max_offpolicy_steps`` is generated again with the current weights, every program is scored, the
advantages are computed per group, each trainer rank gets whole groups (one group is one micro-batch:
the shape the generators re-score with), and the new weights become version ``s``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from stalwart.controller.mesh import ActorsFailed
from stalwart.rl import rollout
from stalwart.rl.balance import Layout, decide
from stalwart.rl.generator import GeneratorActor  # Monarch: rl.driver imports this module after configuring it
from stalwart.rl.setup import sft_rows
from stalwart.rl.trainer import PolicyTrainerActor


def sft(d) -> dict[str, Any]:
    """Supervised warm-up on the trainer mesh: full-batch steps on the fine-tuning examples."""
    cfg = d.cfg
    n = cfg.workers.trainers
    t0 = time.time()
    loss = None
    if d.task.sft and cfg.sft.steps:
        d._build_trainers("sft", 1, cfg.sft.steps)
        rows = sft_rows(d.tok, d.eos, d.task.sft, d.length, d.pad, n)
        for s in range(1, cfg.sft.steps + 1):
            rec = d.trainers.call_all(PolicyTrainerActor.train, lambda r, s=s: (s, [[rows[r]]]), cfg.controller.step_timeout_s)[0]
            loss = rec["loss"]
            d.metrics.write({"step": s, "kind": "sft", "loss": loss, "grad_norm": rec["grad_norm"],
                             "elapsed_s": time.time() - d.t0})
    info = d._build_trainers("rl", cfg.rl.prompts_per_step // n, cfg.rl.steps)
    d.events("rl_trainers", layout=info["layout"], params=info["params"], sft_examples=len(d.task.sft))
    return {"examples": len(d.task.sft), "steps": cfg.sft.steps, "final_loss": loss, "seconds": time.time() - t0}


class Stepper:
    """The RL steps of one run."""

    def __init__(self, d) -> None:
        self.d = d
        r = d.cfg.rl
        self.r = r
        self.ahead = r.max_offpolicy_steps if r.mode == "async" else 0
        self.inflight: dict[int, Any] = {}
        self.ready: dict[int, tuple[list[rollout.Group], dict[str, float]]] = {}  # generated before a rebalance
        self.busy: list[tuple[float, float]] = []  # per step: generator and trainer worker-seconds
        self.loads: list[Any] = []
        self.recoveries = 0
        self.snap_step = 0
        self.curve: list[tuple[int, float]] = []
        self.staleness_max = 0

    def plan(self, s: int) -> list[rollout.GroupRequest]:
        d = self.d
        return rollout.plan_step(s, d.cfg.run.seed, d.task.train, self.r.prompts_per_step, self.r.group_size)

    def _settle_loads(self) -> float:
        """Wait for queued weight loads (they follow the generations issued before them)."""
        t0 = time.perf_counter()
        for p in self.loads:
            self.d.gen.collect(p)
        self.loads = []
        return time.perf_counter() - t0

    def groups_for(self, s: int) -> tuple[list[rollout.Group], dict[str, float]]:
        d = self.d
        if s in self.ready:
            groups, fig = self.ready.pop(s)
        else:
            groups, fig = d._collect_generate(self.inflight.pop(s, None) or d._send_generate(self.plan(s)))
        stale = [g for g in groups if not rollout.admissible(g.version, s, self.ahead)]
        fig["regenerated_groups"] = 0
        while stale:  # too old (or, impossible by construction, newer than the trainer): generate again
            self._settle_loads()
            again, more = d._collect_generate(d._send_generate([g.request for g in stale]))
            fig["regenerated_groups"] += len(again)
            fig["gen_s"] += more["gen_s"]
            fig["rollout_tokens"] += more["rollout_tokens"]
            fresh = {g.gid: g for g in again}
            groups = [fresh.get(g.gid, g) for g in groups]
            stale = [g for g in groups if not rollout.admissible(g.version, s, self.ahead)]
        return groups, fig

    def pack(self, s: int, groups: list[rollout.Group]) -> list[list[list[tuple[np.ndarray, np.ndarray]]]]:
        """Per trainer rank, per update (``rl.updates_per_step`` mini-batches of whole groups), the packed
        micro-batches (one group each); each update's weights make its own aggregate."""
        d, r = self.d, self.r
        n = d.trainers.n
        adv = rollout.advantages([g.rewards for g in groups], r.scale_advantages)
        u = r.updates_per_step
        per_rank: list[list[list]] = [[[] for _ in range(u)] for _ in range(n)]
        size = len(groups) // u
        for j in range(u):
            part = range(j * size, (j + 1) * size)
            weight = rollout.aggregation_weights([groups[i] for i in part], r.aggregation, n, size // n)
            for i in part:
                per_rank[i % n][j].append(rollout.pack_group(groups[i], adv[i], d.length, d.pad, weight, s - 1,
                                                             r.kl_coef > 0))
        return per_rank

    def train(self, s: int, per_rank) -> dict[str, Any]:
        d = self.d
        return d.trainers.call_all(PolicyTrainerActor.train, lambda rank: (s, per_rank[rank]), d.cfg.controller.step_timeout_s)[0]

    def run(self) -> dict[str, Any]:
        d, r = self.d, self.r
        self.take_snapshot(0)
        steps_to = {}
        for s in range(1, r.steps + 1):
            t0 = time.perf_counter()
            busy0 = (sum(d.gen.busy_s), sum(d.rew.busy_s))
            for t in range(s + 1, min(s + self.ahead, r.steps) + 1):  # the generators run ahead meanwhile
                if t not in self.inflight:
                    self.inflight[t] = d._send_generate(self.plan(t))
            groups, gfig = self.groups_for(s)
            sfig = d._score(groups)
            per_rank = self.pack(s, groups)
            stale = [rollout.staleness(g.version, s) for g in groups]
            self.staleness_max = max(self.staleness_max, max(stale))
            d.journal.append("step", step=s, groups=[g.gid for g in groups], versions=[g.version for g in groups])
            rec = self._train_recovering(s, per_rank)
            for g in groups:
                if g.gid in d.trained:
                    raise RuntimeError(f"group {g.gid} would be trained twice (steps {d.trained[g.gid]} and {s})")
                d.trained[g.gid] = s
            d.kept[s] = per_rank
            d.journal.append("applied", sync=False, step=s, loss=rec["loss"], grad_norm=rec["grad_norm"])
            t_sync = time.perf_counter()
            pull_s = self._pull_recovering(s)
            if self.ahead:
                self.loads.append(d._push_weights(s, pending=True))
            else:
                d._push_weights(s)
            sync_s = time.perf_counter() - t_sync
            if s % d.cfg.workers.snapshot_interval == 0:
                self.take_snapshot(s)
            self.busy.append((sum(d.gen.busy_s) - busy0[0], (rec["trainer_s"] + pull_s) * d.trainers.n))
            wall = time.perf_counter() - t0
            rewards = [x for g in groups for x in g.rewards]
            gen_busy = sum(d.gen.busy_s) - busy0[0]
            rew_busy = sum(d.rew.busy_s) - busy0[1]
            trainer_busy = rec["trainer_s"] + pull_s
            record = {"step": s, "kind": "rl", "reward_mean": float(np.mean(rewards)), "reward_std": float(np.std(rewards)),
                      "solved_groups": sum(1 for g in groups if max(g.rewards) == 1.0),
                      "loss": rec["loss"], "grad_norm": rec["grad_norm"],
                      **{k: rec[k] for k in ("kl", "clip_fraction", "entropy", "logprob_mismatch_mean",
                                             "logprob_mismatch_max", "ratio_max", "policy_loss", "train_tokens")},
                      "staleness_mean": float(np.mean(stale)), "staleness_max": max(stale),
                      "weight_version": s, **gfig, **sfig,
                      "rollout_tokens_per_s": gfig["rollout_tokens"] / max(gfig["gen_s"], 1e-9),
                      "trainer_tokens_per_s": rec["train_tokens"] / max(rec["trainer_s"], 1e-9),
                      "train_s": rec["trainer_s"], "weight_sync_s": sync_s, "weight_gather_s": pull_s,
                      "step_s": wall, "elapsed_s": time.time() - d.t0,
                      "generator_idle_frac": max(0.0, 1 - gen_busy / (wall * d.gen.n)),
                      "reward_idle_frac": max(0.0, 1 - rew_busy / (wall * d.rew.n)),
                      "trainer_idle_frac": max(0.0, 1 - trainer_busy / wall),
                      "generators": d.gen.n, "trainers": d.trainers.n}
            d.metrics.write(record)
            w = d.cfg.workers
            if w.balance == "adaptive" and s % w.balance_window == 0 and s < r.steps:
                recent = self.busy[-w.balance_window:]
                gen_b, train_b = (sum(b[i] for b in recent) / len(recent) for i in (0, 1))
                move = decide(gen_b, train_b, Layout(d.gen.n, d.trainers.n), r.prompts_per_step // r.updates_per_step,
                              w.balance_min_gain)
                d.events("rl_balance", step=s, generator_busy_s=gen_b, trainer_busy_s=train_b, generators=d.gen.n,
                         trainers=d.trainers.n, move=None if move is None else [move.to.generators, move.to.trainers])
                if move is not None:
                    self.rebalance(s, move)
            if s % r.eval_interval == 0 and s != r.steps:
                self._settle_loads()
                ev = d.evaluate(f"step-{s}")
                d._eval_record(s, ev)
                self.curve.append((s, ev["held_out_reward"]))
                if ev["held_out_reward"] >= 0.8:
                    steps_to.setdefault("steps_to_0.8", s)
                    steps_to.setdefault("minutes_to_0.8", (time.time() - d.t0) / 60)
        self._settle_loads()
        return {"trainer_recoveries": self.recoveries, "staleness_max": self.staleness_max,
                "groups_trained": len(d.trained), **steps_to}

    # ------------------------------------------------------------------ balancing
    def rebalance(self, s: int, move) -> None:
        """Move workers between the generator and trainer meshes after step ``s``: the generations already
        sent are collected first, the trainers' state goes through a snapshot, and every trainer joins a
        group of the new size and restores it (each keeps its new shard)."""
        d = self.d
        t0 = time.perf_counter()
        before = (d.gen.n, d.trainers.n)
        for t in sorted(self.inflight):
            self.ready[t] = d._collect_generate(self.inflight.pop(t))
        self._settle_loads()
        self.take_snapshot(s)
        while d.trainers.n > move.to.trainers:
            d.trainers.shrink()
        while d.gen.n > move.to.generators:
            d.gen.mesh.shrink()
            d.gen.busy_s.pop()
        while d.gen.n < move.to.generators:
            rank = d.gen.mesh.grow()
            d.gen.busy_s.append(0.0)
            d.gen.mesh.pids[rank] = d.gen.mesh.wait(d.gen.mesh.call(GeneratorActor.warm, (), ranks=[rank]), 600.0,
                                                    "warm")[rank]
            d._restore_generator(rank)
        while d.trainers.n < move.to.trainers:
            rank = d.trainers.grow()
            d.trainers.pids[rank] = d.trainers.wait(d.trainers.call(PolicyTrainerActor.warm, (), ranks=[rank]), 600.0,
                                                    "warm")[rank]
        d.resize_trainers(move.to.trainers)
        d.trainers.call_all(PolicyTrainerActor.restore, (d.snapshot,), 600.0)
        d.events("rl_rebalance", step=s, generators=[before[0], d.gen.n], trainers=[before[1], d.trainers.n],
                 reason=move.reason, seconds=time.perf_counter() - t0, pids={"generators": dict(d.gen.mesh.pids),
                                                                           "trainers": dict(d.trainers.pids)})

    # ------------------------------------------------------------------ trainer recovery
    def take_snapshot(self, s: int) -> None:
        d = self.d
        d.snapshot = d.trainers.call_all(PolicyTrainerActor.snapshot, (), d.cfg.controller.step_timeout_s)[0]
        d.kept = {k: v for k, v in d.kept.items() if k > s}
        self.snap_step = s
        d.journal.append("snapshot", sync=False, step=s)

    def _train_recovering(self, s: int, per_rank) -> dict[str, Any]:
        while True:
            try:
                return self.train(s, per_rank)
            except ActorsFailed as e:
                self.recover(e, s)

    def _pull_recovering(self, s: int) -> float:
        while True:
            try:
                return self.d._pull_weights()
            except ActorsFailed as e:
                self.recover(e, s + 1)

    def recover(self, err: ActorsFailed, s: int) -> None:
        """Replace the failed trainers, restore every trainer from the snapshot, replay the steps since."""
        d = self.d
        self.recoveries += 1
        if self.recoveries > d.cfg.controller.max_recoveries:
            raise err
        failed = sorted({f.rank for f in err.failures})
        for f in err.failures:
            d.events("rl_worker_failure", mesh="trainer", step=s, **f.as_event())
        for rank in range(d.trainers.n):  # a gloo group that lost a member is dead for all: everyone rejoins
            if rank in failed:
                d.trainers.replace(rank)
        try:
            d.trainers.wait(err.pending, d.cfg.controller.step_timeout_s + 2.0, "surviving trainers")
        except ActorsFailed:
            pass
        for rank, pid in d.trainers.call_all(PolicyTrainerActor.warm, (), 600.0).items():
            d.trainers.pids[rank] = pid
        d.store.set(f"attempt-{d.attempt}/abort", "1")
        d.resize_trainers(d.trainers.n)
        d.trainers.call_all(PolicyTrainerActor.restore, (d.snapshot,), 600.0)
        applied = {e["step"]: e for e in d.journal.entries if e.get("cmd") == "applied"}
        replayed = 0
        for t in sorted(k for k in d.kept if self.snap_step < k < s):
            rec = self.train(t, d.kept[t])
            want = applied[t]
            if (rec["loss"], rec["grad_norm"]) != (want["loss"], want["grad_norm"]):
                raise ReplayDiverged(f"replayed step {t} gave loss {rec['loss']!r}, grad norm {rec['grad_norm']!r}; "
                                     f"the journal holds {want['loss']!r}, {want['grad_norm']!r}")
            replayed += 1
        d.journal.append("recovery", ranks=failed, step=s - 1, source="snapshot", snapshot=self.snap_step,
                         replay=replayed)
        d.events("rl_trainer_recovered", ranks=failed, snapshot_step=self.snap_step, replayed=replayed,
                 attempt=d.attempt, pids=dict(d.trainers.pids))


class ReplayDiverged(RuntimeError):
    """A replayed step did not reproduce its journaled result: determinism is broken."""


def run_rl(d) -> dict[str, Any]:
    return Stepper(d).run()
