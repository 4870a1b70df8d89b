"""Weights from the trainers to the generators, as the controller runs it: it names versions and
links and never holds a tensor.

Every generator has a *link*: a standalone group of the trainer ranks and that generator
(``comm.weight_sync``), joined under the controller's store with a prefix of its own per attempt. A
sync of version ``v`` is two calls, sent together: ``send_weights(v)`` on every trainer rank (each
sends its own shards) and ``receive_weights(v)`` on each generator (which assembles the full tensors
and installs them between engine calls). What crosses the controller: the version, the generator
ranks, and replies of a few numbers.

A link is joined again when either side changed: the trainers regrouped (a trainer replaced, the
trainer count changed) or the generator was replaced. A failed transfer installs nothing; a lost
generator is replaced by its pool and brought up (setup, link, the reference from disk, the current
version); a lost trainer fails the sync, and the loop recovers the trainers and publishes again. In
async mode a sync is queued behind the generations sent before it and settled later; a sync whose
trainers have regrouped since is superseded by the next one (a generator that missed it keeps its
older version, and the next, newer one is accepted).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stalwart.controller.mesh import ActorMesh, ActorsFailed
from stalwart.rl.links import link_prefix
from stalwart.rl.services import Generators, Trainers

RETRIES = 3  # a generator whose transfer failed (not lost) is sent the version again this many times


class TrainersFailed(ActorsFailed):
    """A trainer failed while weights were being linked or sent: the trainers must be recovered."""

    @classmethod
    def of(cls, err: ActorsFailed) -> "TrainersFailed":
        return cls(err.failures, err.replies, err.pending)


@dataclass
class Sync:
    """A sync in flight."""
    version: int
    reference: bool
    generators: list[int]
    epoch: int                                   # the trainers' group it was sent from
    incarnations: dict[int, int]                 # each generator's worker it was sent to
    senders: dict[int, Any] = field(default_factory=dict)    # trainer rank -> future
    receivers: dict[int, Any] = field(default_factory=dict)  # generator -> future
    t0: float = 0.0
    tries: int = 0


def gather(calls: list[tuple[ActorMesh, dict[int, Any], float, str]],
           on_failure: Callable[[int, ActorsFailed], None]) -> list[dict[int, Any] | ActorsFailed]:
    """Wait for futures on several meshes at once, each within its own bound: per call, its replies, or
    the failure that ended it (a death or an endpoint error at once, a hang at its bound).
    ``on_failure(call, failure)`` runs as soon as a call fails, so that the others can end too (a hung
    actor is killed first, the very process the call went to: its peers' transfers then fail at once
    instead of waiting)."""
    out: list[dict[int, Any] | ActorsFailed] = [{} for _ in calls]
    pending = [dict(futures) for _, futures, _, _ in calls]
    deadlines = [time.monotonic() + bound for _, _, bound, _ in calls]
    pids = [dict(mesh.pids) for mesh, _, _, _ in calls]
    while any(pending):
        for i, (mesh, _, _, what) in enumerate(calls):
            if not pending[i]:
                continue
            left = deadlines[i] - time.monotonic()
            try:
                out[i].update(mesh.wait(pending[i], max(0.0, min(mesh.report_grace_s + 0.5, left)), what))
                pending[i] = {}
            except ActorsFailed as e:
                out[i].update(e.replies)
                slow = {f.rank: pending[i][f.rank] for f in e.failures if f.cause == "hang"}
                real = [f for f in e.failures if f.cause != "hang"]
                if left > 0 and not real:  # only this slice's bound passed: still running
                    pending[i] = dict(e.pending) | slow
                    continue
                if real:  # the others still running are not hung: they wait on the failed (on_failure frees them)
                    e = ActorsFailed(real, out[i], dict(e.pending) | slow)
                else:
                    e.replies = out[i]
                    for f in e.failures:  # hung past the bound: the very process the call went to
                        if mesh.pids.get(f.rank) == pids[i].get(f.rank):
                            mesh.kill(f.rank)
                out[i], pending[i] = e, {}
                on_failure(i, e)
    return out


class WeightSync:
    def __init__(self, trainers: Trainers, generators: Generators, events: Callable[..., None],
                 abandon: Callable[[str], None], reference_run: str) -> None:
        self.trainers, self.generators, self.events = trainers, generators, events
        self.abandon = abandon               # gives a link's attempt up (its members still waiting leave)
        self.reference_run = reference_run   # where the reference policy is on disk (once written)
        self.has_reference = False
        self.version: int | None = None      # the newest version published
        self.installed: dict[int, int] = {}  # generator -> the version it holds
        self.links: dict[int, tuple[int, int]] = {}  # generator -> (trainer epoch, incarnation) of its link
        self.attempt = 0

    @property
    def pool(self):
        return self.generators.pool

    def _current(self, g: int) -> bool:
        return self.links.get(g) == (self.trainers.epoch, self.pool.incarnation[g])

    def join_links(self, generators: list[int]) -> None:
        """Every named generator whose link is out of date joins a new one with the trainers."""
        from stalwart.rl.generator import GeneratorActor

        t, gm = self.trainers, self.generators
        tries = 0
        todo = [g for g in generators if not self._current(g)]
        while todo:
            g = todo.pop(0)
            if self._current(g):  # brought up meanwhile (a replacement joins its own link)
                continue
            self.attempt += 1
            prefix = link_prefix(g, self.attempt)
            key = (t.epoch, self.pool.incarnation[g])
            senders = t.link(g, self.attempt, gm.n)
            receiver = gm.link(g, self.attempt, t.n, t.store_port, t.timeouts.setup_s, t.link_timeout_s)
            bound = t.timeouts.setup_s + t.timeouts.generate_s  # a generator joins after its queued generations
            got_t, got_g = gather([(t.mesh, senders, bound, "weight link"), (gm.mesh, {g: receiver}, bound,
                                                                             "weight link")],
                                  lambda _i, _e: self.abandon(prefix))
            if isinstance(got_t, ActorsFailed):
                raise TrainersFailed.of(got_t)
            if isinstance(got_g, ActorsFailed):  # the generator is lost: its pool replaces it and brings it up
                self.pool.replace(g, got_g, GeneratorActor.link)
                continue
            if all(rep["ok"] for rep in [*got_t.values(), *got_g.values()]):
                self.links[g] = key
                continue
            tries += 1
            if tries > RETRIES:
                raise RuntimeError(f"generator {g} could not join its weight link: "
                                   f"{[rep['error'] for rep in [*got_t.values(), *got_g.values()] if not rep['ok']]}")
            todo.insert(0, g)

    def publish(self, version: int, reference: bool = False, generators: list[int] | None = None) -> Sync:
        """Start sending ``version`` (the trainers' current weights) to ``generators`` (all by default)."""
        gens = list(range(self.generators.n)) if generators is None else generators
        def wanted(g: int) -> bool:  # one brought up meanwhile may hold it already (never sent it again)
            return reference or self.installed.get(g, -1) < version

        gens = [g for g in gens if wanted(g)]
        self.join_links(gens)
        gens = [g for g in gens if self._current(g) and wanted(g)]
        sync = Sync(version, reference, gens, self.trainers.epoch, {g: self.pool.incarnation[g] for g in gens},
                    t0=time.perf_counter())
        if gens:
            sync.senders = self.trainers.send_weights(version, reference, gens)
            sync.receivers = {g: self.generators.receive_weights(g, version, reference) for g in gens}
        if reference:
            self.has_reference = True
        elif generators is None:
            self.version = version
        return sync

    def settle(self, sync: Sync) -> dict[str, float]:
        """Wait for ``sync``: every generator it went to holds its version, or was replaced and brought up
        to the newest. Raises :class:`TrainersFailed` when a trainer failed and the trainers have not
        regrouped since (the loop recovers them and publishes again)."""
        from stalwart.rl.generator import GeneratorActor

        if not sync.generators:
            return {"weight_sync_s": 0.0}
        t, gm = self.trainers, self.generators
        got_t, got_g = gather([(t.mesh, sync.senders, t.link_timeout_s, "send_weights"),
                               (gm.mesh, sync.receivers, t.link_timeout_s, "receive_weights")], lambda _i, _e: None)
        again: list[int] = []
        if isinstance(got_g, ActorsFailed):
            lost = {f.rank for f in got_g.failures}
            for g in sync.generators:
                if g in lost and self.pool.incarnation[g] == sync.incarnations[g]:
                    self.pool.replace(g, got_g, GeneratorActor.receive_weights)  # brought up to the newest
            got_g = got_g.replies
        for g, rep in got_g.items():
            if self.pool.incarnation[g] != sync.incarnations[g]:
                continue  # replaced since: brought up by its pool
            if rep["ok"]:
                if not sync.reference:
                    self.installed[g] = rep["version"]
            else:
                self.links.pop(g, None)
                again.append(g)
        if isinstance(got_t, ActorsFailed):
            if sync.epoch == t.epoch:
                raise TrainersFailed.of(got_t)
            return {"weight_sync_s": time.perf_counter() - sync.t0, "superseded": 1.0}
        for rep in got_t.values():
            for g in rep["failed"]:
                self.links.pop(g, None)
                if g not in again and self.pool.incarnation[g] == sync.incarnations[g]:
                    again.append(g)
        fig = {"weight_sync_s": time.perf_counter() - sync.t0,
               "weight_send_s": max(rep["send_s"] for rep in got_t.values()),
               "weight_recv_s": max((rep["recv_s"] for rep in got_g.values() if rep.get("ok")), default=0.0)}
        newest = sync.version if sync.reference else self.trainers.version  # what the trainers hold now
        again = [g for g in again if sync.reference or self.installed.get(g, -1) < newest]
        if again:
            if sync.tries >= RETRIES:
                raise RuntimeError(f"weight version {sync.version} did not reach generators {again} after "
                                   f"{RETRIES} tries")
            self.events("rl_weight_resync", version=newest, generators=again, reference=sync.reference)
            retry = self.publish(newest, sync.reference, again)
            retry.tries = sync.tries + 1
            self.settle(retry)
        return fig

    def forget(self, generator: int) -> None:
        """A generator that left the pool (the last rank)."""
        self.links.pop(generator, None)
        self.installed.pop(generator, None)

    def bring_up(self, generator: int) -> None:
        """A new generator (a replacement, or one more): its engine, its link, the reference, the newest
        version."""
        self.generators.setup([generator])
        self.installed.pop(generator, None)
        if self.has_reference:
            self.join_links([generator])
            self.generators.load_reference(generator, self.reference_run)
        if self.version is None:
            return
        try:  # the trainers' weights now (trained, maybe not yet published)
            self.settle(self.publish(self.trainers.version, False, [generator]))
        except TrainersFailed as e:  # it stays behind: catch_up brings it up once the trainers are recovered
            self.events("rl_generator_behind", generator=generator, error=str(e))

    def behind(self) -> list[int]:
        """Generators that do not hold the trainers' current weights (a newcomer whose bring-up met a
        trainer failure, a sync that failed)."""
        if self.version is None:
            return []
        return [g for g in range(self.generators.n) if self.installed.get(g, -1) < self.trainers.version]

    def catch_up(self) -> None:
        """Every generator holds the trainers' current weights (raises ``TrainersFailed``)."""
        if self.behind():
            self.settle(self.publish(self.trainers.version, False, self.behind()))
