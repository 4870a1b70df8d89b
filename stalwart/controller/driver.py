"""``stalwart train --controller``: one controller process drives a mesh of trainer actors.

The controller owns the data feed, the command journal and the recovery; the actors own the model
state (``stalwart.controller.actor``). Per step it journals the command (step N and its batch
reference), sends every actor its micro-batches, waits for all of them with a bound, and journals the
applied optimizer step (learning rate, loss, gradient norm). When an actor fails, the recovery
(``stalwart.controller.replay.Recovery``, the one RL's trainers use too) names it, replaces it, has
every actor rejoin a new group and restore the newest in-memory snapshot (the survivors keep their
processes) or disk checkpoint (``controller.recover_from``), and replays the journal's steps since
then; a replayed step must reproduce the journaled loss, learning rate and gradient norm bit for bit,
or the run stops. The step that failed is then issued again.

Events (``events.jsonl``, documented in docs/controller.md): ``controller_start``,
``controller_actor`` (per-actor phase), ``controller_health``, ``controller_failure``,
``controller_recovered``, ``controller_finished``; and the run-wide ``launch``, ``failure``,
``resumed``, ``recovered``, ``supervisor_exit`` that goodput accounts with.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any

from stalwart.config.job import JobConfig
from stalwart.controller.feed import Feed
from stalwart.controller.journal import Journal, config_key, earlier_results, issued_steps
from stalwart.controller.mesh import ActorMesh, ActorsFailed, configure_monarch
from stalwart.controller.recovery import hang_bound, keeps_survivors, recovery_source
from stalwart.controller.replay import (RecoveriesExhausted, Recovery, RecoveryRole, ReplayDiverged, Restored,
                                        divergence)
from stalwart.ft.plan import read_fired
from stalwart.ft.runlock import drop_unowned_snapshots
from stalwart.metrics.records import EventLog
from stalwart.parallel.dims import ParallelDims
from stalwart.paths import RunPaths
from stalwart.runtime.group import controller_store

SETUP_TIMEOUT_S = 600.0  # building the model and resuming: bounded by the actors' own init
# What a replayed step must reproduce bit for bit: its result and, at the steps that take one, the
# training state's fingerprint (train/fingerprint.py: parameters, optimizer state, RNG, data position).
MATCHED = ("lr", "loss", "grad_norm", "fingerprint")
# The sections that define a run's numbers: a session resumed with equal ones checks an earlier one's steps.
DEFINING = ("run", "model", "data", "optimizer", "scheduler", "training", "parallelism", "comm")


def _absolute(cfg: JobConfig) -> JobConfig:
    """Relative paths made absolute: the actors' processes need not share the controller's directory."""
    run = dataclasses.replace(cfg.run, dir=str(RunPaths.of(cfg.run).root.resolve()))
    data = cfg.data
    if data.path and Path(data.path).exists():
        data = dataclasses.replace(data, path=str(Path(data.path).resolve()))
    return dataclasses.replace(cfg, run=run, data=data)


class Controller:
    def __init__(self, cfg: JobConfig, nproc: int) -> None:
        self.cfg, self.n = _absolute(cfg), nproc
        self.ccfg = cfg.controller
        self.paths = RunPaths.of(self.cfg.run)
        self.dims = ParallelDims.resolve(cfg.parallelism, nproc)
        self.paths.root.mkdir(parents=True, exist_ok=True)
        drop_unowned_snapshots(self.paths, self.paths.snapshots(self.cfg.checkpoint.memory_dir))
        self.events = EventLog(self.paths.events)
        # The process groups' rendezvous store lives here, so it outlives any actor.
        self.store = controller_store(nproc, SETUP_TIMEOUT_S)
        self.attempt = 0
        self.source = recovery_source(self.ccfg.recover_from, self.cfg.checkpoint.memory_interval)
        # Per step, seconds of: the whole step, the controller's data, its journal writes, and the send
        # and wait beyond the slowest actor's own time in the step (Monarch's dispatch overhead).
        self.timing: dict[str, list[float]] = {k: [] for k in ("step_wall_s", "data_s", "journal_s", "dispatch_s")}
        self.mesh: ActorMesh | None = None
        self.feed: Feed | None = None
        self.journal: Journal | None = None
        self.recovery: Recovery | None = None
        self.session_start = 0
        # Steps an earlier session (one this controller's crash ended) completed after the resumed step:
        # each is computed again and must reproduce its journaled batch and result (journal.earlier_results).
        self.checks: dict[int, dict[str, Any]] = {}
        self.checked = 0

    @property
    def recoveries(self) -> int:
        return self.recovery.count if self.recovery is not None else 0

    # ------------------------------------------------------------------ actors
    def _phase(self, ranks, phase: str, **fields: Any) -> None:
        for r in ranks:
            self.events("controller_actor", rank=r, phase=phase, attempt=self.attempt, **fields)

    def _join(self) -> None:
        from stalwart.controller.actor import TrainerActor  # Monarch: imported after configure_monarch

        # A collective waits at most a step's bound: an actor blocked on a hung peer then fails as a peer
        # ("peer" cause), and only the hung actor is still running when the controller's bound expires.
        timeout = min(self.cfg.fault.collective_timeout_s, self.ccfg.step_timeout_s)
        replies = self.mesh.call_all(TrainerActor.join, lambda r: (self.cfg, r, self.n, self.store.port, self.attempt,
                                                                   timeout, SETUP_TIMEOUT_S), SETUP_TIMEOUT_S)
        for r, rep in replies.items():
            self.mesh.pids[r] = rep["pid"]
            self.events("controller_actor", rank=r, phase="joined", attempt=self.attempt, pid=rep["pid"])

    def _health(self, step: int) -> None:
        self.events("controller_health", step=step, alive=list(range(self.n)), actors=self.n,
                    journal_seq=self.journal.seq, attempt=self.attempt, recoveries=self.recoveries,
                    pids=dict(self.mesh.pids))

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        configure_monarch(self.ccfg.supervision_poll_s)
        os.environ.setdefault("OMP_NUM_THREADS", str(self.cfg.launch.threads(self.n)))
        self.events("launch", engine="controller", nproc_per_node=self.n)
        try:
            return self._run()
        finally:
            if self.feed is not None:
                self.feed.close()
            if self.mesh is not None:
                self.mesh.stop()
            if self.journal is not None:
                self.journal.close()
            self.events("supervisor_exit", engine="controller", recoveries=self.recoveries)
            self.events.close()

    def _run(self) -> dict[str, Any]:
        from stalwart.controller.actor import TrainerActor  # imports Monarch: after configure_monarch

        self.mesh = ActorMesh.spawn(TrainerActor, "trainer", self.n, self.ccfg.spares)
        self.mesh.report_grace_s = self.ccfg.supervision_poll_s + 0.25
        self._phase(range(self.n), "spawned")
        self._join()
        begun = self.mesh.call_all(TrainerActor.begin, (), SETUP_TIMEOUT_S)
        step, end = begun[0]["step"], begun[0]["end"]
        self.session_start = step
        self.feed = Feed(self.cfg, self.paths, self.dims)
        self.feed.seek(begun[0]["data"])
        self.journal = Journal(self.paths.journal)
        key = config_key({**{k: dataclasses.asdict(getattr(self.cfg, k)) for k in DEFINING}, "actors": self.n})
        self.checks = earlier_results(self.journal.entries, step, key)
        self.journal.append("session", step=step, actors=self.n, layout=self.dims.describe(), config=key,
                            source=begun[0]["source"], checks=len(self.checks))
        if self.checks:
            self.events("controller_resume", step=step, source=begun[0]["source"], checks=len(self.checks),
                        check_to=max(self.checks))
        role = RecoveryRole(attempt=lambda: self.attempt, rebuild=self._rebuild, restore=self._restore,
                            replay=self._replay, matched=MATCHED, keeps_survivors=keeps_survivors(self.source))
        self.recovery = Recovery(self.mesh, self.store, self.journal, role, self.events,
                                 max_recoveries=self.ccfg.max_recoveries, settle_s=self.ccfg.step_timeout_s + 2.0,
                                 engine="controller", fired=lambda: read_fired(self.paths))
        self.events("controller_start", step=step, end=end, actors=self.n, pids=dict(self.mesh.pids),
                    layout=self.dims.describe(), journal=str(self.paths.journal), journal_seq=self.journal.seq,
                    step_timeout_s=self.ccfg.step_timeout_s, supervision_poll_s=self.ccfg.supervision_poll_s,
                    recover_from=self.ccfg.recover_from)
        self._phase(range(self.n), "training", step=step)
        while step < end:
            try:
                self._step(step + 1)
                step += 1
                self.recovery.step_done(step)
                if step % self.cfg.metrics.log_interval == 0:
                    self._health(step)
            except ActorsFailed as e:  # the step is retried from where the recovery left the actors
                step = self.recovery.recover(e, step + 1)
        finished = self.mesh.call_all(TrainerActor.finish, (), SETUP_TIMEOUT_S)
        self._phase(range(self.n), "finished", step=step)
        summary = finished[0]["summary"]
        summary["controller"] = self._figures(step)
        self.events("controller_finished", **summary["controller"])
        return summary

    def _figures(self, step: int) -> dict[str, Any]:
        med = {k: statistics.median(v) if v else None for k, v in self.timing.items()}
        dispatch = med["dispatch_s"]
        return {"step": step, "recoveries": self.recoveries, "journal_seq": self.journal.seq, "actors": self.n,
                "resumed_checks": self.checked,
                "dispatch_overhead_s": dispatch,
                "dispatch_overhead_per_actor_s": dispatch / self.n if dispatch is not None else None,
                "data_s": med["data_s"], "journal_s": med["journal_s"], "step_wall_s": med["step_wall_s"],
                "steps_measured": len(self.timing["dispatch_s"])}

    # ------------------------------------------------------------------ steps
    def _step(self, n: int) -> None:
        """Issue step ``n``: journal it, send every actor its share of the feed's next batch, wait,
        journal the result."""
        t0 = time.perf_counter()
        before = self.feed.position()
        micro = self.feed.next()
        t1 = time.perf_counter()
        self.journal.append("step", step=n, batch=before)
        t2 = time.perf_counter()
        replies = self._send(n, micro)
        t3 = time.perf_counter()
        rec = replies[0]
        self._check_earlier(n, before, rec)
        self.journal.append("applied", sync=False, step=n, **{k: rec[k] for k in MATCHED if k in rec})
        self._journal_snapshot(n)
        t4 = time.perf_counter()
        if not self.recovery.recovering:  # the first step after a recovery is no measure of dispatch
            self.timing["step_wall_s"].append(t4 - t0)
            self.timing["data_s"].append(t1 - t0)
            self.timing["journal_s"].append(t2 - t1 + t4 - t3)
            self.timing["dispatch_s"].append(t3 - t2 - max(r["actor_s"] for r in replies.values()))

    def _check_earlier(self, n: int, before: dict, rec: dict[str, Any]) -> None:
        """Step ``n`` completed before, in a session this controller's crash ended: it must have read the
        same batch and reproduced the same result, bit for bit (else ``ReplayDiverged``)."""
        earlier = self.checks.get(n)
        if earlier is None:
            return
        if earlier["issued"]["batch"] != before:
            raise ReplayDiverged(f"resumed step {n} read the batch at {before}, the journal issued it at "
                                 f"{earlier['issued']['batch']}")
        problem = divergence(n, rec, earlier["applied"], MATCHED)
        if problem is not None:
            raise ReplayDiverged(problem)
        self.checked += 1

    def _send(self, n: int, micro: list) -> dict[int, Any]:
        """Step ``n`` on every actor (each its share of ``micro``, and the data position after it)."""
        from stalwart.controller.actor import TrainerActor

        after = self.feed.position()
        futures = self.mesh.call(TrainerActor.step, lambda r: (n, self.feed.share(micro, r), after))
        return self.mesh.wait(futures, hang_bound(self.ccfg.step_timeout_s), f"step {n}")

    def _journal_snapshot(self, n: int) -> None:
        if self.cfg.checkpoint.memory_interval and n % self.cfg.checkpoint.memory_interval == 0 and n != (
                self.cfg.training.stop_at_step or self.cfg.training.steps):
            self.journal.append("snapshot", sync=False, step=n)

    # ------------------------------------------------------------------ the recovery's role
    def _rebuild(self) -> None:
        """Every actor (the survivors and the replacements) joins the next group attempt."""
        self.attempt += 1
        self._join()

    def _restore(self) -> Restored:
        """Every actor restores the recovery's source (``memory`` or ``disk``, else its initialisation)."""
        from stalwart.controller.actor import TrainerActor

        restored = self.mesh.call_all(TrainerActor.restore, (self.source, self.session_start), SETUP_TIMEOUT_S)
        steps = {rep["step"] for rep in restored.values()}
        if len(steps) != 1:
            raise RuntimeError(f"actors restored different steps: { {r: rep['step'] for r, rep in restored.items()} }")
        self.feed.seek(restored[0]["data"])
        return Restored(steps.pop(), restored[0]["source"],
                        {"disk_loads": {r: rep["disk_loads"] for r, rep in restored.items()}})

    def _replay(self, n: int) -> dict[str, Any]:
        """Step ``n`` again, on the batch the journal issued it with; its result (rank 0's reply)."""
        self.feed.seek(issued_steps(self.journal.entries)[n]["batch"])
        rec = self._send(n, self.feed.next())[0]
        self._journal_snapshot(n)
        return rec


def run_controller(cfg: JobConfig, nproc: int) -> int:
    """``stalwart train --controller``: the whole job from this process; returns the exit code. The
    CLI's preflight (``launch.preflight``, shared with the SPMD path) has checked the layout, the
    data and the device (``training.device`` on this host for ``nproc`` actors) before any actor exists."""
    from stalwart.ft.runlock import LOCK_HOLDER_ENV, RunLock
    from stalwart.train.worker import format_summary

    with RunLock(RunPaths.of(cfg.run)):
        os.environ[LOCK_HOLDER_ENV] = str(os.getpid())
        try:
            summary = Controller(cfg, nproc).run()
        except RecoveriesExhausted as e:
            print(f"stalwart train: {e}", flush=True)
            return e.exit_code
        except ReplayDiverged as e:  # determinism broke: the run is not what its journal says it was
            print(f"stalwart train: {e}", flush=True)
            return 1
    print(format_summary(summary), flush=True)
    c = summary["controller"]
    if c["dispatch_overhead_s"] is not None:
        print(f"  controller      {c['actors']} actors, {c['recoveries']} recoveries, journal at seq "
              f"{c['journal_seq']}; dispatch overhead {1e3 * c['dispatch_overhead_per_actor_s']:.3f} ms per actor "
              f"per step (median of {c['steps_measured']})", flush=True)
    return 0
