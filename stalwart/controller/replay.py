"""One recovery for a group of trainer actors a controller drives: ``stalwart train --controller``'s
trainers, and RL's trainer mesh.

A command that failed (:class:`ActorsFailed`) starts :meth:`Recovery.recover`, which

1. names what failed (``<engine>_failure`` per actor, the run-wide ``failure`` that goodput reads; the
   root causes, when the fault struck and which injected fault it was: ``recovery.py``'s pure
   functions) and counts the recovery against ``controller.max_recoveries``
   (:class:`RecoveriesExhausted` beyond it);
2. abandons the group attempt the actors were in (``runtime.group.abandon_attempt``: an actor still
   waiting in its rendezvous leaves it), kills the failed actors, lets the survivors' commands end
   (one still running after ``settle_s`` is replaced too) and puts a spare or a new process in each
   failed rank (every rank, when the role restores from disk and keeps no survivor);
3. has the role rebuild the group (every actor joins the next attempt) and restore a state;
4. journals the recovery and announces ``resumed``;
5. replays every step the journal holds a result of since the restored step, and checks each
   replayed result against the journal bit for bit (:class:`ReplayDiverged`).

A failure during 2-5 starts the recovery again (and counts again). ``recover`` returns the step the
actors are at; the caller then retries the command that failed and reports every step it completes
(:meth:`Recovery.step_done`): the first one ends the recovery (``recovered``, ``<engine>_recovered``).

What differs between the roles is passed in as a :class:`RecoveryRole`: how to rebuild, how to
restore, how to replay one step, which result fields must match. The decisions are pure functions
(:func:`replay_steps`, :func:`divergence`, and ``recovery.py``'s), the clock is injected.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from stalwart.controller.journal import Journal, applied_records
from stalwart.controller.mesh import ActorMesh, ActorsFailed
from stalwart.controller.recovery import Failure, fault_origin, root_causes
from stalwart.ft.detect import EXIT_RESTART_BUDGET
from stalwart.runtime.group import abandon_attempt


class ReplayDiverged(RuntimeError):
    """A replayed step did not reproduce its journaled result: determinism is broken."""


class RecoveriesExhausted(RuntimeError):
    """More actor failures than ``controller.max_recoveries``: the run stops (exit 75, as a supervisor
    whose restart budget is spent)."""

    exit_code = EXIT_RESTART_BUDGET


@dataclass(frozen=True)
class Restored:
    """Where a restore left every actor: ``step``, restored from ``source``; ``detail`` goes into the
    ``<engine>_recovered`` event as it is."""

    step: int
    source: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RecoveryRole:
    """The parts of a recovery that depend on the actors recovered."""

    attempt: Callable[[], int]               # the group attempt the actors are in now
    rebuild: Callable[[], None]              # every actor joins the next group attempt and builds on it
    restore: Callable[[], Restored]          # every actor restores the newest state it has
    replay: Callable[[int], dict[str, Any]]  # run step n again, as the journal issued it; its result
    matched: tuple[str, ...]                 # result fields a replay must reproduce bit for bit
    keeps_survivors: bool = True             # False: every actor is replaced (a restore from disk)


def replay_steps(applied: Mapping[int, Any], restored: int) -> list[int]:
    """The steps to run again after a restore to step ``restored``: every step after it with a
    journaled result, in order. A gap is a journal that cannot be replayed (``ValueError``)."""
    steps = sorted(s for s in applied if s > restored)
    if steps != list(range(restored + 1, restored + 1 + len(steps))):
        missing = sorted(set(range(restored + 1, steps[-1])) - set(steps))
        raise ValueError(f"journal has no result for step(s) {missing} after step {restored}")
    return steps


def divergence(step: int, got: Mapping[str, Any], want: Mapping[str, Any], fields: Iterable[str]) -> str | None:
    """None when ``got`` reproduces ``want`` in every field bit for bit; else what differs, in words. A
    field missing on either side (a state fingerprint is taken every few steps) is not compared."""
    fields = tuple(k for k in fields if k in want and k in got)
    if all(got[k] == want[k] for k in fields):
        return None
    return (f"replayed step {step} gave { {k: got[k] for k in fields} }, the journal holds "
            f"{ {k: want[k] for k in fields} }")


class Recovery:
    """Recovers the actors of ``mesh`` (see the module's docstring); ``events`` is the run's event log,
    ``engine`` names its events (``controller`` -> ``controller_failure``, ...)."""

    def __init__(self, mesh: ActorMesh, store: dist.Store, journal: Journal, role: RecoveryRole,
                 events: Callable[..., None], *, max_recoveries: int, settle_s: float, engine: str,
                 fired: Callable[[], list[dict]] = list, clock: Callable[[], float] = time.time) -> None:
        self.mesh, self.store, self.journal, self.role, self.events = mesh, store, journal, role, events
        self.max_recoveries, self.settle_s, self.engine = max_recoveries, settle_s, engine
        self.fired, self.clock = fired, clock
        self.count = 0                         # recoveries started, retries included
        self.pending: dict[str, Any] | None = None  # a recovery whose first completed step is awaited
        self._injected: set[str] = set()      # fired fault ids already attributed to a failure
        self._running: int | None = None      # the step being replayed

    @property
    def recovering(self) -> bool:
        return self.pending is not None

    def phase(self, ranks: Iterable[int], phase: str, **fields: Any) -> None:
        for r in ranks:
            self.events(f"{self.engine}_actor", rank=r, phase=phase, attempt=self.role.attempt(), **fields)

    # ------------------------------------------------------------------ recover
    def recover(self, err: ActorsFailed, step: int) -> int:
        """Recover from ``err``, raised while step ``step`` ran (a step the journal holds the result of
        is replayed; one it does not is the caller's to retry). Returns the step the actors are at."""
        while True:
            self._running = None
            try:
                return self._recover(err, step)
            except ActorsFailed as again:  # an actor failed while recovering: recover again
                err, step = again, self._running if self._running is not None else step

    def _recover(self, err: ActorsFailed, step: int) -> int:
        first = self._announce(err, step)
        self.count += 1
        if self.count > self.max_recoveries:
            raise RecoveriesExhausted(f"actor failures exceeded controller.max_recoveries ({self.max_recoveries}): "
                                      f"{err}")
        abandon_attempt(self.store, self.role.attempt())
        failed = sorted({f.rank for f in root_causes(err.failures)})
        self.phase(failed, "failed", step=step)
        survivors: list[int] = []
        if self.role.keeps_survivors:
            for r in failed:
                self.mesh.kill(r)
            self._settle(err, failed)
            survivors = [r for r in range(self.mesh.n) if r not in failed]
        for r in range(self.mesh.n):
            if r not in survivors:
                self.events(f"{self.engine}_actor", rank=r, phase="replaced", attempt=self.role.attempt(),
                            by=self.mesh.replace(r))
        self.role.rebuild()
        restored = self.role.restore()
        applied = applied_records(self.journal.entries)
        steps = replay_steps(applied, restored.step)
        recomputed = len(steps) + (step not in applied)  # the failed step, when it had not completed
        self.journal.append("recovery", ranks=failed, cause=first.cause, step=restored.step, source=restored.source,
                            replay=recomputed)
        attempt = self.role.attempt()
        self.events("resumed", step=restored.step, source=restored.source, attempt=attempt, engine=self.engine)
        self.phase(range(self.mesh.n), "replaying" if recomputed else "training", step=restored.step)
        self.pending = {"failure": first, "failed": failed, "survivors": survivors, "source": restored.source,
                        "restored_step": restored.step, "replay": recomputed, "failed_step": step,
                        "restored_s": self.clock() - first.fault_time, **restored.detail}
        for t in steps:
            self._running = t
            problem = divergence(t, self.role.replay(t), applied[t], self.role.matched)
            if problem is not None:
                raise ReplayDiverged(problem)
            self.pending.setdefault("fault_to_step_s", self.clock() - first.fault_time)
        return steps[-1] if steps else restored.step

    def _announce(self, err: ActorsFailed, step: int) -> Failure:
        """Every failure, then the one that started it as the run-wide ``failure``; returns that one,
        dated when its fault struck."""
        attempt = self.role.attempt()
        for f in err.failures:
            self.events(f"{self.engine}_failure", step=step, attempt=attempt, root=f.root, **f.as_event())
        first = min(root_causes(err.failures), key=lambda f: f.fault_time)
        fault_time, injected = fault_origin(first, err.failures, self.fired(), step, self._injected)
        first = dataclasses.replace(first, fault_time=fault_time)
        self.events("failure", kind=first.cause, rank=first.rank, step=step, attempt=attempt,
                    detect_time=first.detect_time, fault_time=fault_time, injected=injected,
                    detection_latency_s=first.detect_time - fault_time, source=self.engine, decision="recover")
        return first

    def _settle(self, err: ActorsFailed, failed: list[int]) -> None:
        """The survivors' commands end once the failed actors are gone (the group reports the lost
        peer): collect them, bounded; an actor still running then is added to ``failed``."""
        others = {r: f for r, f in err.pending.items() if r not in failed}
        try:
            self.mesh.wait(others, self.settle_s, "a command of a surviving actor")
        except ActorsFailed as e:
            for f in e.failures:
                if f.cause == "hang":
                    failed.append(f.rank)
                self.events(f"{self.engine}_failure", step=None, attempt=self.role.attempt(), root=False,
                            **f.as_event())

    # ------------------------------------------------------------------ caught up
    def step_done(self, step: int) -> None:
        """The caller completed ``step``: the first completion after a recovery ends it."""
        p = self.pending
        if p is None:
            return
        self.pending = None
        f: Failure = p["failure"]
        now = self.clock()
        p.setdefault("fault_to_step_s", now - f.fault_time)
        rec = {k: v for k, v in p.items() if k != "failure"}
        rec.update(rank=f.rank, cause=f.cause, caught_up_s=now - f.fault_time, step=step)
        attempt = self.role.attempt()
        self.events("recovered", attempt=attempt, recovery_s=p["restored_s"], fault_to_step_s=p["fault_to_step_s"],
                    steps_recomputed=p["replay"], engine=self.engine)
        self.events(f"{self.engine}_recovered", **rec)
        self.phase(range(self.mesh.n), "training", step=step)
