"""``stalwart train --controller``: one controller process drives a mesh of trainer actors.

The controller owns the data feed, the command journal and the recovery; the actors own the model
state (``stalwart.controller.actor``). Per step it journals the command (step N and its batch
reference), sends every actor its micro-batches, waits for all of them with a bound, and journals the
applied optimizer step (learning rate, loss, gradient norm). When an actor fails it names it
(``recovery.classify``), replaces it, restores every actor to the newest in-memory snapshot (the
survivors keep their processes) or disk checkpoint (``controller.recover_from``), and replays the
journal's steps since then; a replayed step must reproduce the journaled loss, learning rate and
gradient norm bit for bit, or the run stops.

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
from datetime import timedelta
from pathlib import Path
from typing import Any

from stalwart.config.job import JobConfig
from stalwart.controller.feed import Feed
from stalwart.controller.journal import Journal, applied_records, replay_plan
from stalwart.controller.mesh import ActorMesh, ActorsFailed, configure_monarch
from stalwart.controller.recovery import (Failure, fault_origin, hang_bound, keeps_survivors, recovery_source,
                                         root_causes)
from stalwart.ft.plan import read_fired
from stalwart.ft.detect import EXIT_RESTART_BUDGET
from stalwart.metrics.records import EventLog
from stalwart.parallel.dims import ParallelDims
from stalwart.paths import RunPaths

SETUP_TIMEOUT_S = 600.0  # building the model and resuming: bounded by the actors' own init


class ReplayDiverged(RuntimeError):
    """A replayed step did not reproduce its journaled result: determinism is broken."""


def _absolute(cfg: JobConfig) -> JobConfig:
    """Relative paths made absolute: the actors' processes need not share the controller's directory."""
    run = dataclasses.replace(cfg.run, dir=str(RunPaths.of(cfg.run).root.resolve()))
    data = cfg.data
    if data.path and Path(data.path).exists():
        data = dataclasses.replace(data, path=str(Path(data.path).resolve()))
    return dataclasses.replace(cfg, run=run, data=data)


class Controller:
    def __init__(self, cfg: JobConfig, nproc: int) -> None:
        import torch.distributed as dist

        self.cfg, self.n = _absolute(cfg), nproc
        self.ccfg = cfg.controller
        self.paths = RunPaths.of(self.cfg.run)
        self.dims = ParallelDims.resolve(cfg.parallelism, nproc)
        self.paths.root.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.paths.events)
        # The process groups' rendezvous store lives here, so it outlives any actor.
        self.store = dist.TCPStore("127.0.0.1", 0, nproc, True, timeout=timedelta(seconds=SETUP_TIMEOUT_S),
                                   wait_for_workers=False)
        self.attempt = 0
        self.recoveries = 0
        # Per step, seconds of: the whole step, the controller's data, its journal writes, and the send
        # and wait beyond the slowest actor's own time in the step (Monarch's dispatch overhead).
        self.timing: dict[str, list[float]] = {k: [] for k in ("step_wall_s", "data_s", "journal_s", "dispatch_s")}
        self.mesh: ActorMesh | None = None
        self.feed: Feed | None = None
        self.journal: Journal | None = None
        self._pending_recovery: dict[str, Any] | None = None
        self._injected: set[str] = set()  # fired fault ids already attributed to a failure
        self.session_start = 0

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
        self.journal.append("session", step=step, actors=self.n, layout=self.dims.describe())
        self.events("controller_start", step=step, end=end, actors=self.n, pids=dict(self.mesh.pids),
                    layout=self.dims.describe(), journal=str(self.paths.journal), journal_seq=self.journal.seq,
                    step_timeout_s=self.ccfg.step_timeout_s, supervision_poll_s=self.ccfg.supervision_poll_s,
                    recover_from=self.ccfg.recover_from)
        self._phase(range(self.n), "training", step=step)
        queue: list[dict[str, Any]] = []
        while step < end:
            try:
                self._step(step + 1, queue.pop(0) if queue else None)
                step += 1
                if self._pending_recovery is not None:
                    self._recovered(step, bool(queue))
                if step % self.cfg.metrics.log_interval == 0:
                    self._health(step)
            except ActorsFailed as e:
                step, queue = self._recover(e, step + 1)
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
                "dispatch_overhead_s": dispatch,
                "dispatch_overhead_per_actor_s": dispatch / self.n if dispatch is not None else None,
                "data_s": med["data_s"], "journal_s": med["journal_s"], "step_wall_s": med["step_wall_s"],
                "steps_measured": len(self.timing["dispatch_s"])}

    def _step(self, n: int, replay: dict[str, Any] | None) -> None:
        """Send step ``n`` to every actor and wait; ``replay`` is its journal entry when replaying."""
        from stalwart.controller.actor import TrainerActor

        t0 = time.perf_counter()
        if replay is not None:
            self.feed.seek(replay["batch"])
        before = self.feed.position()
        micro = self.feed.next()
        after = self.feed.position()
        t1 = time.perf_counter()
        if replay is None:
            self.journal.append("step", step=n, batch=before)
        t2 = time.perf_counter()
        futures = self.mesh.call(TrainerActor.step, lambda r: (n, self.feed.share(micro, r), after))
        replies = self.mesh.wait(futures, hang_bound(self.ccfg.step_timeout_s), f"step {n}")
        t3 = time.perf_counter()
        rec = replies[0]
        if replay is None or n not in (done := applied_records(self.journal.entries)):
            self.journal.append("applied", sync=False, step=n, lr=rec["lr"], loss=rec["loss"],
                                grad_norm=rec["grad_norm"])
        else:
            want = done[n]
            got = {k: rec[k] for k in ("lr", "loss", "grad_norm")}
            if got != {k: want[k] for k in got}:
                raise ReplayDiverged(f"replayed step {n} gave {got}, the journal holds "
                                     f"{ {k: want[k] for k in got} }")
        if self.cfg.checkpoint.memory_interval and n % self.cfg.checkpoint.memory_interval == 0 and n != (
                self.cfg.training.stop_at_step or self.cfg.training.steps):
            self.journal.append("snapshot", sync=False, step=n)
        t4 = time.perf_counter()
        if replay is None and self._pending_recovery is None:
            self.timing["step_wall_s"].append(t4 - t0)
            self.timing["data_s"].append(t1 - t0)
            self.timing["journal_s"].append(t2 - t1 + t4 - t3)
            self.timing["dispatch_s"].append(t3 - t2 - max(r["actor_s"] for r in replies.values()))

    # ------------------------------------------------------------------ recovery
    def _recover(self, err: ActorsFailed, step: int) -> tuple[int, list[dict[str, Any]]]:
        """Replace the failed actors, restore every actor, and return (restored step, steps to replay).
        An actor that fails during the recovery starts another one (within controller.max_recoveries)."""
        while True:
            try:
                return self._recover_once(err, step)
            except ActorsFailed as again:
                self.store.set(f"attempt-{self.attempt}/abort", "1")  # the others leave that group's rendezvous
                err = again

    def _recover_once(self, err: ActorsFailed, step: int) -> tuple[int, list[dict[str, Any]]]:
        from stalwart.controller.actor import TrainerActor

        roots = root_causes(err.failures)
        for f in err.failures:
            self.events("controller_failure", step=step, attempt=self.attempt, root=f.root, **f.as_event())
        first = min(roots, key=lambda f: f.fault_time)
        fault_time, injected = fault_origin(first, err.failures, read_fired(self.paths), step, self._injected)
        first = dataclasses.replace(first, fault_time=fault_time)
        self.events("failure", kind=first.cause, rank=first.rank, step=step, attempt=self.attempt,
                    detect_time=first.detect_time, fault_time=fault_time, injected=injected,
                    detection_latency_s=first.detect_time - fault_time, source="controller", decision="recover")
        self.recoveries += 1
        if self.recoveries > self.ccfg.max_recoveries:
            raise ControllerGaveUp(f"actor failures exceeded controller.max_recoveries ({self.ccfg.max_recoveries}): "
                                   f"{err}")
        source = recovery_source(self.ccfg.recover_from, self.cfg.checkpoint.memory_interval)
        failed = sorted({f.rank for f in roots})
        self._phase(failed, "failed", step=step)
        if keeps_survivors(source):
            for r in failed:
                self.mesh.kill(r)
            self._settle(err, failed)
            survivors = [r for r in range(self.n) if r not in failed]
        else:
            survivors = []
        replaced = [r for r in range(self.n) if r not in survivors]
        for r in replaced:
            self.events("controller_actor", rank=r, phase="replaced", attempt=self.attempt, by=self.mesh.replace(r))
        self.attempt += 1
        self._join()
        restored = self.mesh.call_all(TrainerActor.restore, (source, self.session_start), SETUP_TIMEOUT_S)
        steps = {rep["step"] for rep in restored.values()}
        if len(steps) != 1:
            raise RuntimeError(f"actors restored different steps: { {r: rep['step'] for r, rep in restored.items()} }")
        at = steps.pop()
        self.feed.seek(restored[0]["data"])
        plan = replay_plan(self.journal.entries, at)
        got = restored[0]["source"]
        self.journal.append("recovery", ranks=failed, cause=first.cause, step=at, source=got, replay=len(plan))
        self.events("resumed", step=at, source=got, attempt=self.attempt, engine="controller")
        self._phase(range(self.n), "replaying" if plan else "training", step=at)
        self._pending_recovery = {"failure": first, "failed": failed, "survivors": survivors, "source": got,
                                  "restored_step": at, "replay": len(plan), "failed_step": step,
                                  "restored_s": time.time() - first.fault_time,
                                  "disk_loads": {r: rep["disk_loads"] for r, rep in restored.items()}}
        return at, plan

    def _settle(self, err: ActorsFailed, failed: list[int]) -> None:
        """The survivors' commands end once the failed actors are gone (gloo reports the lost peer):
        collect them, bounded; an actor still running then is replaced too."""
        others = {r: f for r, f in err.pending.items() if r not in failed}
        try:
            self.mesh.wait(others, self.ccfg.step_timeout_s + 2.0, "a command of a surviving actor")
        except ActorsFailed as e:
            for f in e.failures:
                if f.cause == "hang":
                    failed.append(f.rank)
                self.events("controller_failure", step=None, attempt=self.attempt, root=False, **f.as_event())

    def _recovered(self, step: int, replaying: bool) -> None:
        """After the first step completed since a recovery (and again when the replay has caught up)."""
        p = self._pending_recovery
        f: Failure = p["failure"]
        now = time.time()
        if "fault_to_step_s" not in p:
            p["fault_to_step_s"] = now - f.fault_time
        if replaying:
            return
        self._pending_recovery = None
        rec = {k: v for k, v in p.items() if k != "failure"}
        rec.update(rank=f.rank, cause=f.cause, caught_up_s=now - f.fault_time, step=step)
        self.events("recovered", attempt=self.attempt, recovery_s=p["restored_s"],
                    fault_to_step_s=p["fault_to_step_s"], steps_recomputed=p["replay"], engine="controller")
        self.events("controller_recovered", **rec)
        self._phase(range(self.n), "training", step=step)


class ControllerGaveUp(RuntimeError):
    exit_code = EXIT_RESTART_BUDGET


def run_controller(cfg: JobConfig, nproc: int) -> int:
    """``stalwart train --controller``: the whole job from this process; returns the exit code."""
    from stalwart.ft.runlock import LOCK_HOLDER_ENV, RunLock
    from stalwart.train.worker import format_summary

    with RunLock(RunPaths.of(cfg.run)):
        os.environ[LOCK_HOLDER_ENV] = str(os.getpid())
        try:
            summary = Controller(cfg, nproc).run()
        except ControllerGaveUp as e:
            print(f"stalwart train: {e}", flush=True)
            return e.exit_code
    print(format_summary(summary), flush=True)
    c = summary["controller"]
    if c["dispatch_overhead_s"] is not None:
        print(f"  controller      {c['actors']} actors, {c['recoveries']} recoveries, journal at seq "
              f"{c['journal_seq']}; dispatch overhead {1e3 * c['dispatch_overhead_per_actor_s']:.3f} ms per actor "
              f"per step (median of {c['steps_measured']})", flush=True)
    return 0
