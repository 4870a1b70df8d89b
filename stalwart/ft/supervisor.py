"""The supervisor's decisions, separate from processes: what failed, when, and what to do about it.

``Supervisor`` is driven by the elastic agent (``stalwart.ft.agent``) once per monitor tick and on
each failure/restart. It reads only files (heartbeats, fired-fault markers, checkpoint and snapshot
directories) and takes the clock as an argument, so its logic is unit-tested without processes.
Events it writes to ``events.jsonl``: ``launch``, ``startup`` (each attempt's start-up, phase by
phase and rank by rank), ``failure``, ``restart``, ``recovered``, ``fault_injected`` (chaos),
``supervisor_exit``.

Where a failure is seen first-hand, by the agent watching its own processes each tick (an exit, a
stopped process), the failed rank is the one whose process failed and the fault time is the last tick
it was seen running (or its own exit record's time, or its newest start-up mark when it died before
any tick saw it), so detection latency is measured to within ``fault.monitor_interval_s``.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stalwart.ft.detect import (
    BUDGET_EXHAUSTED,
    CRASH_LOOP,
    EXCLUDE,
    EXIT_RESTART_BUDGET,
    EXIT_ROLLBACK,
    EXIT_USER_ERROR,
    RESTART,
    Beat,
    FailureSig,
    RestartPolicy,
    Stall,
    check_heartbeat,
)
from stalwart.checkpoint.manager import newest_complete_checkpoint
from stalwart.checkpoint.snapshot import SnapshotStore
from stalwart.ft.origin import oom_kills, oom_since, outside_fault
from stalwart.ft.plan import ChaosSchedule, read_fired
from stalwart.ft.runlock import drop_unowned_snapshots
from stalwart.ft.records import read_exit_records, read_heartbeats, read_startup, startup_event, startup_phase
from stalwart.paths import RunPaths, checkpoint_step

def newest_state_step(run_dir: Path, snapshot_dir: Path | None) -> int:
    """Newest step a restart could resume from: a complete checkpoint, or a snapshot every rank has."""
    done = newest_complete_checkpoint(RunPaths(run_dir).checkpoints)
    best = checkpoint_step(done) if done is not None else -1
    if snapshot_dir is not None:
        best = max([best, *SnapshotStore.common_steps(Path(snapshot_dir))])
    return best


def read_beats(paths: RunPaths, ranks: list[int]) -> dict[int, Beat]:
    out = {}
    for r, rec in read_heartbeats(paths, ranks).items():
        try:
            out[r] = Beat.from_dict(rec)
        except (KeyError, TypeError, ValueError):
            continue
    return out


def classify(exitcode: int | None) -> str:
    if exitcode is None:
        return "crash"
    if exitcode < 0:
        return "signal"
    if exitcode == EXIT_ROLLBACK:
        return "rollback"
    if exitcode == EXIT_USER_ERROR:
        return "user_error"
    if exitcode == EXIT_RESTART_BUDGET:  # a worker saved its step on SIGTERM (train/preempt.py): requeue
        return "preempted"
    return "crash"


def failure_line(rank: int, what: str, decision: str = RESTART) -> str:
    """The one console line of a failure the supervisor saw: the rank, what happened to it, and what
    the supervisor does next (the launcher prints the line of a hang with this too)."""
    then = "restarting the group" if decision in (RESTART, EXCLUDE) else "stopping the group"
    return f"stalwart supervisor: rank {rank} {what}; {then}"


def describe_exit(kind: str, exitcode: int | None, phase: str, step: int, outside: bool) -> str:
    """How a worker that left by itself (or was killed) failed, in words, for ``failure_line``."""
    if exitcode is not None and exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    elif kind == "rollback":
        how = "asked for a rollback to the last good state"
    elif exitcode is None:
        how = "failed"
    else:
        how = f"exited with code {exitcode} (its message is above)"
    where = f"while training (after step {step})" if phase == "train" else f"in start-up ({phase})"
    origin = " from outside (not counted toward fault.crash_loop_restarts)" if outside else ""
    return f"{how}{origin} {where}"


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class _Failure:
    kind: str
    rank: int
    step: int
    fault_time: float
    detect_time: float


@dataclass
class Supervisor:
    cfg: object                 # the job's `fault` section
    run_dir: Path
    snapshot_dir: Path | None
    max_restarts: int
    ranks: list[int]            # global ranks of this node's workers
    log_event: Callable[..., None]
    attempt: int = 0
    attempt_start: float = 0.0
    verdict: str = ""           # "", restart, crash_loop, budget_exhausted, user_error
    failures: list[dict] = field(default_factory=list)
    _pending: _Failure | None = None
    _max_step: int = 0
    _recovered: bool = False
    _chaos: ChaosSchedule | None = None
    _chaos_queue: list = field(default_factory=list)
    _t0: float = 0.0
    _chaos_fired: list = field(default_factory=list)
    host_size: int = 1                 # ranks per host (exclusion unit)
    steps_are_progress: bool = False   # a replica group (group_recovery): the steps it trained count as progress
    host_failures: dict = field(default_factory=dict)
    excluded_host: int | None = None
    _seen_running: dict = field(default_factory=dict)   # rank -> the last tick its process was seen running
    _stopped_since: dict = field(default_factory=dict)  # rank -> the first tick its process was seen stopped
    _begun: float = 0.0                # when this attempt's start began (launch, or the failure's handling)
    _resume_step: int = 0              # the step this attempt resumes from, as far as the supervisor knows
    _command_start: float | None = None
    _startup_reported: bool = False
    say: Callable[[str], None] = _stderr_line            # the console line of each failure it handles
    read_oom: Callable[[], dict] = oom_kills             # the kernel's OOM-kill counters (ft/origin.py)
    _oom_mark: dict = field(default_factory=dict)        # their reading at the previous failure or the launch

    def __post_init__(self) -> None:
        self.paths = RunPaths(self.run_dir)
        drop_unowned_snapshots(self.paths, self.snapshot_dir)  # a deleted run's, before the first attempt
        self.policy = RestartPolicy(self.max_restarts, self.cfg.crash_loop_restarts,
                                    newest_state_step(self.run_dir, self.snapshot_dir))
        if self.cfg.chaos_mtbf_s > 0:
            self._chaos = ChaosSchedule(self.cfg.chaos_mtbf_s, self.cfg.chaos_seed, tuple(self.cfg.chaos_kinds),
                                        len(self.ranks))

    # ------------------------------------------------------------------ lifecycle
    def launched(self, now: float, **info) -> None:
        self._t0 = self.attempt_start = self._begun = now
        self._oom_mark = self.read_oom()
        self._resume_step = max(0, self.policy.progress)
        self._command_start = info.get("command_start")  # the launcher process's start, where known
        self.log_event("launch", time=now, max_restarts=self.max_restarts, ranks=self.ranks,
                       progress_step=self.policy.progress, **info)

    def restarted(self, now: float, stop_s: float) -> None:
        self.attempt += 1
        self.attempt_start = now
        self._begun = now - stop_s
        self._recovered = self._startup_reported = False
        self._max_step = 0
        self._seen_running.clear()
        self._stopped_since.clear()
        self._resume_step = max(0, newest_state_step(self.run_dir, self.snapshot_dir))
        self.log_event("restart", time=now, attempt=self.attempt, remaining_restarts=self.max_restarts -
                       self.policy.restarts, progress_step=self.policy.progress, restart_s=round(stop_s, 3))

    # ------------------------------------------------------------------ monitoring
    def poll(self, now: float, states: dict[int, str] | None = None) -> Stall | None:
        """One monitor tick while the group is healthy: recovery bookkeeping, then the watchdog.
        ``states``: the agent's own view of its workers' processes, rank -> 'running' or 'stopped'."""
        beats = read_beats(self.paths, self.ranks)
        current = {r: b for r, b in beats.items() if b.attempt == self.attempt and b.beat_time >= self.attempt_start}
        if current:
            self._max_step = max([self._max_step] + [b.step for b in current.values()])
        if not self._recovered and current and len(current) == len(self.ranks) and all(
                b.step > b.resumed_step for b in current.values()):
            self._recovered = True
            self._on_recovered(current)
        if self._recovered and not self._startup_reported:
            self._report_startup(current)
        stalls = [s for r in self.ranks if (s := check_heartbeat(
            beats.get(r), r, now, self.attempt_start, self.attempt, self.cfg.heartbeat_timeout_s,
            self.cfg.progress_timeout_s, self.cfg.init_timeout_s)) is not None]
        stalls += self._stopped(now, states or {})
        if not stalls:
            return None
        # Peers of a hung rank stop progressing too (they wait in its collective): blame the rank an
        # injected fault hit, else one whose heartbeat stopped (a stopped process), else the oldest stall.
        injected = {f["rank"] for f in self.injected_since(self.attempt_start) if f.get("kind") == "hang"}
        return min(stalls, key=lambda s: (s.rank not in injected, s.kind != "unresponsive", s.since, s.rank))

    def _stopped(self, now: float, states: dict[int, str]) -> list[Stall]:
        """Ranks whose process has been stopped (SIGSTOP, a debugger) for longer than
        ``fault.heartbeat_timeout_s``: seen by the agent itself, so in every phase, start-up included."""
        for r, state in states.items():
            if state == "running":
                self._seen_running[r] = now
                self._stopped_since.pop(r, None)
            elif state == "stopped":
                self._stopped_since.setdefault(r, now)
        limit = self.cfg.heartbeat_timeout_s
        return [Stall("unresponsive", r, self._step_of(), self._seen_running.get(r, t),
                      f"its process has been stopped for {now - t:.1f} s (fault.heartbeat_timeout_s = {limit:g})")
                for r, t in self._stopped_since.items() if now - t > limit]

    def _step_of(self) -> int:
        """The newest step this attempt completed, else the step it resumes from."""
        return max(self._max_step, self._resume_step)

    def phase_of(self, rank: int) -> str:
        """Where ``rank`` was: 'train' once its heartbeat says it trains (or finishes), else its start-up phase."""
        beat = read_beats(self.paths, [rank]).get(rank)
        if beat is not None and beat.attempt == self.attempt and beat.beat_time >= self.attempt_start and (
                beat.phase != "init"):
            return "train"
        return startup_phase(read_startup(self.paths, [rank], self._begun).get(rank))

    def _report_startup(self, beats: dict[int, Beat]) -> None:
        """The ``startup`` event of this attempt, from the ranks' start-up records (``startup_event``)."""
        event = startup_event(read_startup(self.paths, list(beats), self._begun), self._begun,
                              self._command_start if self.attempt == 0 else None)
        if event is not None:
            self._startup_reported = True
            self.log_event("startup", attempt=self.attempt, resumed_step=min(b.resumed_step for b in beats.values()),
                           **event)

    def _on_recovered(self, beats: dict[int, Beat]) -> None:
        f, self._pending = self._pending, None
        if f is None:
            return
        done = max(b.progress_time for b in beats.values())  # the step is done when every rank is
        resumed = min(b.resumed_step for b in beats.values())
        self.log_event("recovered", attempt=self.attempt, failure_kind=f.kind, failure_step=f.step,
                       resumed_step=resumed, steps_recomputed=max(0, f.step - resumed),
                       recovery_s=round(done - f.detect_time, 3), fault_to_step_s=round(done - f.fault_time, 3))

    def chaos_due(self, now: float) -> list[tuple[float, str, int]]:
        """Chaos faults to inject now (at most one, and only once the group trains again)."""
        if self._chaos is None:
            return []
        self._chaos_queue += self._chaos.due(now - self._t0)
        if not self._recovered or self._pending is not None or not self._chaos_queue:
            return []
        return [self._chaos_queue.pop(0)]

    def chaos_injected(self, now: float, kind: str, rank: int, pid: int) -> None:
        rec = {"kind": kind, "rank": rank, "step": self._max_step + 1, "time": now, "source": "chaos", "pid": pid}
        self._chaos_fired.append(rec)
        self.log_event("fault_injected", **rec)

    # ------------------------------------------------------------------ failures
    def injected_since(self, since: float) -> list[dict]:
        """Injected faults (plan markers and chaos) that fired in this attempt, oldest first."""
        return sorted([f for f in read_fired(self.paths) + self._chaos_fired
                       if f.get("time", 0) >= since - 1e-3 and f.get("kind") in ("kill", "hang", "exception")],
                      key=lambda f: f["time"])

    def on_failure(self, now: float, kind: str, rank: int, exitcode: int | None = None,
                   stall: Stall | None = None) -> str:
        """Record a failure and decide: RESTART, EXCLUDE, CRASH_LOOP, BUDGET_EXHAUSTED or user_error."""
        step = self._step_of()
        injected = self.injected_since(self.attempt_start)
        fault_time = injected[-1]["time"] if injected else (
            stall.since if stall is not None else self._last_sign_of_life(rank, now))
        if injected:
            step = max(step, int(injected[-1].get("step", step)) - 1)
        progress = newest_state_step(self.run_dir, self.snapshot_dir)
        if self.steps_are_progress:  # a replica group's state lives in the other groups' memory
            progress = max(progress, self._max_step)
        phase = self.phase_of(rank)
        own = read_exit_records(self.paths, self.attempt_start).get(rank)
        oom_now = self.read_oom()
        oom, self._oom_mark = oom_since(self._oom_mark, oom_now), oom_now
        outside = outside_fault(kind, exitcode, own is not None, any(f.get("source") != "chaos" for f in injected),
                                rank in self._stopped_since, oom)
        host = rank // self.host_size if rank >= 0 else -1
        self.host_failures[host] = self.host_failures.get(host, 0) + (kind != "rollback")
        if kind in ("user_error", "preempted"):  # never restarted: fix the command / requeue the job
            decision = kind
        elif self.cfg.exclude_after and host >= 0 and self.host_failures[host] >= self.cfg.exclude_after:
            decision = EXCLUDE
            self.excluded_host = host
        else:
            decision = self.policy.on_failure(progress, FailureSig.of(phase, kind, exitcode, own and own.get("error"),
                                                                      outside))
        rec = {"kind": kind, "rank": rank, "host": host, "step": step, "phase": phase, "exitcode": exitcode,
               "attempt": self.attempt, "fault_time": fault_time, "detect_time": now,
               "detection_latency_s": round(now - fault_time, 3),
               "injected": injected[-1]["kind"] if injected else None, "progress_step": progress,
               "decision": decision, "failures_in_a_row": self.policy.no_progress, "from_outside": outside,
               "oom_kill": oom}
        if stall is not None:
            rec["detail"] = stall.detail
        stopped = sorted(r for r in self._stopped_since if r != rank)
        if stopped:  # stopped as well, but not (yet) past the timeout: said, not blamed
            rec["also_stopped"] = stopped
        self.failures.append(rec)
        self.log_event("failure", time=now, **rec)
        if stall is None and kind not in ("user_error", "preempted"):  # the launcher prints a hang's line itself
            self.say(failure_line(rank, describe_exit(kind, exitcode, phase, step, outside), decision))
        self._pending = _Failure(kind, rank, step, fault_time, now)
        self.verdict = decision
        return decision

    def _last_sign_of_life(self, rank: int, now: float) -> float:
        """When a failed rank was last known alive: its exit record (a crash notes the moment), else the
        later of the last tick the agent saw its process running and its newest heartbeat of this attempt
        (a kill leaves no record; the tick is at most fault.monitor_interval_s early)."""
        rec = read_exit_records(self.paths, self.attempt_start).get(rank)
        if rec is not None:
            return min(now, rec["time"])
        seen = [self._seen_running[rank]] if rank in self._seen_running else []
        beat = read_beats(self.paths, [rank]).get(rank)
        if beat is not None and beat.attempt == self.attempt and beat.beat_time >= self.attempt_start:
            seen.append(beat.beat_time)
        start = read_startup(self.paths, [rank], self.attempt_start).get(rank)
        if start is not None and start["phases"][-1][1] <= now:  # each start-up mark was written by the
            seen.append(start["phases"][-1][1])  # living process: a kill before any tick saw it leaves these
        return min(now, max(seen)) if seen else now

    def finished(self, now: float, code: int) -> None:
        self.log_event("supervisor_exit", time=now, code=code, verdict="finished" if code == 0 else self.verdict,
                       restarts=self.policy.restarts, failures=len(self.failures))


__all__ = ["BUDGET_EXHAUSTED", "CRASH_LOOP", "EXCLUDE", "RESTART", "Supervisor", "classify", "newest_state_step"]


def now() -> float:
    return time.time()
