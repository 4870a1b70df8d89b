"""RL's services as the controller's loop sees them: typed objects over the actor meshes.

    trainers.train(step, rows_per_dp_rank) -> record       the trainer mesh (one process group)
    generators.generate(requests) -> Generation            the generator pool (dealt groups)
    generators.collect(generation) -> (groups, figures)
    rewards.score(groups) -> figures                       the reward pool (verdicts kept per program)
    weights.publish(version) / weights.settle(sync)        rl/weights.py: trainers -> generators

Each calls its actors' endpoints through typed references (``PolicyTrainerActor.train``), never by
name, and holds no tensor: rows and groups go out, records and groups come back; weights move
between the actors themselves (``rl/weights.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.controller.gang import GangMesh, PerMember
from stalwart.controller.mesh import ActorMesh
from stalwart.parallel.dims import ParallelDims
from stalwart.rl import rollout
from stalwart.rl.pools import Pending, Pool, deal

SETUP_S = 600.0


@dataclass(frozen=True)
class Timeouts:
    step_s: float      # a trainer command (a step, a sync on the trainers' side)
    setup_s: float     # joining a group, building a core, a snapshot
    generate_s: float  # a generation call (a generator busy past it is hung)


class Trainers:
    """The trainer mesh: one process group of ``n`` ranks training one policy."""

    def __init__(self, mesh: ActorMesh, cfg: Any, store_port: int, snapshot_dir: str, timeouts: Timeouts,
                 abandon: Callable[[int], None]) -> None:
        self.mesh, self.cfg, self.store_port, self.snapshot_dir = mesh, cfg, store_port, snapshot_dir
        self.timeouts = timeouts
        self.abandon = abandon  # gives an attempt of the group up (actors still waiting to join leave)
        self.attempt = 0
        self.epoch = 0          # bumped whenever the group is rebuilt: every weight link must be joined again
        self.version = 0        # the step the trainers' weights are at (what a weight sync can send now)

    @property
    def n(self) -> int:
        return self.mesh.n

    @property
    def layout(self) -> ParallelDims:
        """The trainers' parallel layout at their current count (the one ``TrainCore`` builds)."""
        return ParallelDims.resolve(self.cfg.parallelism, self.n)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: a step's groups are dealt to these; the tensor-parallel ranks of one share them."""
        return self.layout.dp

    @property
    def pids(self) -> dict[int, int]:
        return self.mesh.pids

    def _all(self, endpoint: Any, args: tuple | Callable[[int], tuple] = (), timeout_s: float | None = None) -> dict:
        return self.mesh.call_all(endpoint, args, self.timeouts.setup_s if timeout_s is None else timeout_s)

    def join(self) -> None:
        """Every trainer joins the group's current attempt (its size is the mesh's)."""
        from stalwart.rl.trainer import PolicyTrainerActor

        n, t = self.n, self.timeouts
        replies = self._all(PolicyTrainerActor.join, lambda r: (self.cfg, r, n, self.store_port, self.attempt,
                                                                t.step_s, t.setup_s, self.snapshot_dir))
        for r, rep in replies.items():
            self.mesh.pids[r] = rep["pid"]
        self.epoch += 1

    def regroup(self) -> None:
        """A new attempt of the group (the old one lost a member or changes size): every trainer joins it."""
        self.abandon(self.attempt)
        self.attempt += 1
        self.join()

    def build(self, phase: str, args: Any, length: int, micro_per_rank: int, steps: int) -> dict[str, Any]:
        from stalwart.rl.trainer import PolicyTrainerActor

        info = self._all(PolicyTrainerActor.build, (phase, args, length, micro_per_rank, steps))[0]
        self.version = 0
        return info

    def train(self, step: int, per_rank: list) -> dict[str, Any]:
        """One training step on every rank (rows per data-parallel rank: the tensor-parallel ranks of one take
        the same); rank 0's record. Raises ``ActorsFailed``."""
        from stalwart.rl.trainer import PolicyTrainerActor

        dims = self.layout
        rec = self._all(PolicyTrainerActor.train, lambda rank: (step, per_rank[dims.dp_rank(rank)]),
                        self.timeouts.step_s)[0]
        self.version = step
        return rec

    def snapshot(self, step: int) -> int:
        """Every rank keeps its own shard at ``step`` (in memory, a copy on a peer); bytes on rank 0."""
        from stalwart.rl.trainer import PolicyTrainerActor

        return self._all(PolicyTrainerActor.snapshot, (step,))[0]["bytes"]

    def restore(self, step: int | None = None) -> int:
        """Every rank loads the snapshot of ``step`` (default: the newest complete one); its step."""
        from stalwart.rl.trainer import PolicyTrainerActor

        self.version = self._all(PolicyTrainerActor.restore, (step,))[0]["step"]
        return self.version

    def save_checkpoint(self, root: str) -> str:
        from stalwart.rl.trainer import PolicyTrainerActor

        return self._all(PolicyTrainerActor.save_checkpoint, (root,))[0]

    def load_checkpoint(self, path: str) -> int:
        from stalwart.rl.trainer import PolicyTrainerActor

        self.version = self._all(PolicyTrainerActor.load_checkpoint, (path,))[0]["step"]
        return self.version

    def link(self, generator: int, attempt: int, generators: int) -> dict[int, Any]:
        """Every rank starts joining ``generator``'s weight link; the futures."""
        from stalwart.rl.trainer import PolicyTrainerActor

        t = self.timeouts
        return self.mesh.call(PolicyTrainerActor.link, (generator, attempt, generators, self.store_port, t.setup_s,
                                                        self.link_timeout_s, self.cfg.workers.generator_tp))

    def send_weights(self, version: int, reference: bool, generators: list[int]) -> dict[int, Any]:
        """Every rank starts sending its pieces of ``version`` to ``generators``; the futures."""
        from stalwart.rl.trainer import PolicyTrainerActor

        return self.mesh.call(PolicyTrainerActor.send_weights, (version, reference, generators))

    @property
    def link_timeout_s(self) -> float:
        """How long one transfer on a link may wait: a generator takes its sync after the generations
        queued before it (at most one generation call's bound), then the transfer itself."""
        return self.timeouts.generate_s + self.timeouts.step_s

    def warm(self, ranks: list[int] | None = None) -> None:
        from stalwart.rl.trainer import PolicyTrainerActor

        for rank, pid in self.mesh.call_all(PolicyTrainerActor.warm, (), self.timeouts.setup_s, ranks).items():
            self.mesh.pids[rank] = pid


@dataclass
class Generation:
    """Groups sent to the generators and not yet collected."""
    pending: Pending


class Generators:
    """The generator pool: engines that sample whole groups; a lost generator's groups are sampled again.
    Each generator is a gang of ``workers.generator_tp`` processes (``controller/gang.py``); each setup
    forms its process group anew, as attempt ``attempts`` of that generator's scope on the store."""

    def __init__(self, pool: Pool, prompts: dict[str, list[int]], setup_args: tuple, store_port: int,
                 timeouts: Timeouts) -> None:
        self.pool, self.prompts, self.setup_args = pool, prompts, setup_args
        self.store_port, self.timeouts = store_port, timeouts
        self.attempts = 0

    @property
    def n(self) -> int:
        return self.pool.n

    @property
    def mesh(self) -> GangMesh:
        return self.pool.mesh

    def _setup_args(self) -> PerMember:
        from stalwart.rl.generator import Member

        self.attempts += 1
        attempt, t, width = self.attempts, self.timeouts, self.mesh.width
        return PerMember(lambda r, m: (*self.setup_args, r, Member(m, width, self.store_port, attempt, t.setup_s,
                                                                   t.generate_s)))

    def setup(self, ranks: list[int] | None = None) -> None:
        """Build the engines (every generator, or ``ranks`` without repair: a newcomer's restore)."""
        from stalwart.rl.generator import GeneratorActor

        if ranks is None:
            self.pool.call_all(GeneratorActor.setup, self._setup_args())
            return
        m = self.mesh
        m.wait(m.call(GeneratorActor.setup, self._setup_args(), ranks=ranks), SETUP_S, "generator setup")

    def generate(self, requests: list[rollout.GroupRequest]) -> Generation:
        from stalwart.rl.generator import GeneratorActor

        return Generation(self.pool.send(GeneratorActor.generate, deal(requests, self.n),
                                         lambda reqs: (reqs, [self.prompts[q.instance.key] for q in reqs])))

    def collect(self, generation: Generation) -> tuple[list[rollout.Group], dict[str, float]]:
        replies = self.pool.collect(generation.pending)
        groups = sorted((g for rep in replies.values() for g in rep["groups"]), key=lambda g: g.request.index)
        for r, rep in replies.items():
            self.pool.busy_s[r] += rep["gen_s"] + rep["rescore_s"]
        fig = {"gen_s": max(rep["gen_s"] for rep in replies.values()),
               "rescore_s": max(rep["rescore_s"] for rep in replies.values()),
               "rollout_tokens": sum(rep["tokens"] for rep in replies.values())}
        if "episodes" in replies[min(replies)]:  # several turns: how many the episodes took, what was fed back
            total = {k: sum(rep[k] for rep in replies.values()) for k in ("episodes", "episode_turns",
                                                                         "feedback_tokens", "visible_passed")}
            fig.update(turns_mean=total["episode_turns"] / max(total["episodes"], 1),
                       feedback_tokens=total["feedback_tokens"], visible_passed=total["visible_passed"])
        gaps = [rep["sampler_gap"] for rep in replies.values() if "sampler_gap" in rep]
        if gaps and sum(g[2] for g in gaps):  # exact mode: the sampler's log-probabilities against the re-scored
            fig.update(sampler_mismatch_mean=sum(g[0] for g in gaps) / sum(g[2] for g in gaps),
                       sampler_mismatch_max=max(g[1] for g in gaps))
        return groups, fig

    def run(self, requests: list[rollout.GroupRequest]) -> tuple[list[rollout.Group], dict[str, float]]:
        return self.collect(self.generate(requests))

    def link(self, generator: int, attempt: int, trainers: int, store_port: int, setup_s: float,
             timeout_s: float) -> Any:
        from stalwart.rl.generator import GeneratorActor

        return self.mesh.call(GeneratorActor.link, (generator, attempt, trainers, self.n, store_port, setup_s,
                                                    timeout_s), ranks=[generator])[generator]

    def receive_weights(self, generator: int, version: int, reference: bool) -> Any:
        from stalwart.rl.generator import GeneratorActor

        return self.mesh.call(GeneratorActor.receive_weights, (version, reference), ranks=[generator])[generator]

    def load_reference(self, generator: int, run: str) -> None:
        from stalwart.rl.generator import GeneratorActor

        m = self.mesh
        m.wait(m.call(GeneratorActor.load_reference, (run,), ranks=[generator]), SETUP_S, "generator load_reference")


class Rewards:
    """The reward pool: every distinct (instance, program) is run once in the sandbox."""

    def __init__(self, pool: Pool, cases: dict[str, list[tuple[str, str]]], program: Callable[[list[int]], str],
                 setup_args: tuple) -> None:
        self.pool, self.cases, self.program, self.setup_args = pool, cases, program, setup_args
        self.verdicts: dict[tuple[str, str], tuple] = {}  # (instance, program) -> verdict

    @property
    def n(self) -> int:
        return self.pool.n

    def setup(self, ranks: list[int] | None = None) -> None:
        from stalwart.rl.reward import RewardActor

        if ranks is None:
            self.pool.call_all(RewardActor.setup, self.setup_args)
            return
        m = self.pool.mesh
        m.wait(m.call(RewardActor.setup, self.setup_args, ranks=ranks), SETUP_S, "reward setup")

    def score(self, groups: list[rollout.Group]) -> dict[str, float]:
        """Every response's reward (set on its group); a program already run for that instance is not
        run again."""
        from stalwart.rl.reward import RewardActor

        t0 = time.perf_counter()
        jobs = []
        for g in groups:
            key = g.request.instance.key
            for resp in g.programs():  # a multi-turn episode is scored on its last program
                prog = self.program(resp)
                if (key, prog) not in self.verdicts and (key, prog) not in jobs:
                    jobs.append((key, prog))
        if jobs:
            pending = self.pool.send(RewardActor.score, deal(jobs, self.n),
                                     lambda chunk: ([(prog, self.cases[key]) for key, prog in chunk],))
            pieces = {r: chunk for r, (_, (chunk, _)) in pending.pieces.items()}
            for r, rep in self.pool.collect(pending).items():
                self.pool.busy_s[r] += rep["seconds"]
                for job, verdict in zip(pieces[r], rep["verdicts"]):
                    self.verdicts[job] = tuple(verdict)
        for g in groups:
            key = g.request.instance.key
            vs = [self.verdicts[(key, self.program(resp))] for resp in g.programs()]
            g.rewards = [v[0] for v in vs]
            g.verdicts = [v[3] for v in vs]
        return {"score_s": time.perf_counter() - t0, "programs_run": len(jobs)}
