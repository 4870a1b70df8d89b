"""One replication of a long job: interruptions, recovery and checkpoints, event by event.

The job runs on a fixed set of hosts; unplanned interruptions arrive as a Poisson process (the
superposition of every cause's process over every GPU/host in the job) on the wall clock, so a
fault during a restart restarts the recovery. Between interruptions the checkpoint cadence is
handled in closed form (no event per checkpoint), which keeps a 54-day, 16k-GPU replication at a
few hundred loop iterations.

Two recovery models share this one loop. Whole-job restart (``groups == 1``): every fault stops
every rank, which re-initialises and restores the last durable checkpoint. Per replica group
(``groups == R > 1``): a fault whose cause is group-local stops only the group it hits; the
survivors wait for it to be noticed (detection), rebuild their cross-group communicator, then train
on at (R - a)/R of full throughput while ``a`` groups are away, keeping the global batch; the failed
group swaps its host, re-initialises alone and rejoins by a live transfer from a survivor, which
stalls the survivors for the transfer only. Nothing is rolled back. A job-wide cause, a fault that
leaves no group training, or any fault while the whole job is restarting falls back to the
whole-job restart, which also waits for the hosts of groups that were away.

Time is classified into: productive (work later kept), lost (work since the last durable
checkpoint, thrown away by a whole-job rollback), detection, restart (re-initialise + restore),
spare_wait (no spare host left: wait for a repair), checkpoint (stalls to save), maintenance
(planned downtime), degraded (the share of the job that was away while the survivors trained) and
regroup (survivors stalled rebuilding their communicator and receiving a rejoining group).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

BUCKETS = ("productive", "lost", "detection", "restart", "spare_wait", "checkpoint", "maintenance", "degraded",
           "regroup")
PRODUCTIVE, LOST, DETECTION, RESTART, SPARE_WAIT, CHECKPOINT, MAINTENANCE, DEGRADED, REGROUP = range(len(BUCKETS))


@dataclass(frozen=True)
class JobModel:
    """Everything one replication needs, in seconds and per-second rates (built by ``build_job_model``)."""

    horizon_s: float
    cause_names: tuple[str, ...]
    cause_rate_s: np.ndarray      # (causes,) interruptions per second for the whole job
    detect_s: np.ndarray          # (causes,)
    hardware: np.ndarray          # (causes,) bool
    interval_s: float             # work between checkpoints
    stall_s: float                # wall time training stalls per checkpoint
    persist_s: float              # extra delay until a checkpoint is durable (async); 0 when sync
    final_save_s: float           # stall of the checkpoint taken before a planned stop
    restart_s: float              # re-initialise + restore
    swap_s: float                 # bring a spare host in
    spare_hosts: int
    repair_mean_s: float
    maint_interval_s: float       # 0 = no planned interruptions
    maint_downtime_s: float
    groups: int = 1               # replica groups that recover alone; 1 = whole-job restarts only
    job_wide: np.ndarray | None = None   # (causes,) bool: the cause stops every group
    group_restart_s: float = 0.0  # a failed group's own re-initialisation (its state comes by transfer)
    regroup_s: float = 0.0        # survivors stall to rebuild the cross-group communicator
    transfer_s: float = 0.0       # survivors stall while a rejoining group receives the state

    @property
    def total_rate_s(self) -> float:
        return float(self.cause_rate_s.sum())

    @property
    def rollback_rate_s(self) -> np.ndarray:
        """(causes,) rates of the faults that restart the whole job and roll it back to a checkpoint."""
        if self.groups == 1 or self.job_wide is None:
            return self.cause_rate_s
        return self.cause_rate_s * self.job_wide


@dataclass
class RepResult:
    seconds: np.ndarray                   # (len(BUCKETS),) wall seconds per bucket; sums to the horizon
    cause_counts: np.ndarray              # (causes,) unplanned interruptions
    planned: int
    checkpoints: int
    down_intervals: list[tuple[float, float]] = field(default_factory=list)  # for power and plots
    group_recoveries: int = 0             # faults that stopped one replica group only

    @property
    def ettr(self) -> float:
        return float(self.seconds[PRODUCTIVE] / self.seconds.sum())


def fault_segment(length: float, m: JobModel) -> tuple[float, float, float, int]:
    """A running stretch of ``length`` seconds ended by a fault: (kept, lost, stalled, checkpoints)."""
    period = m.interval_s + m.stall_s
    n = int(length // period)
    rem = length - n * period
    if rem > m.interval_s:          # the fault hit during a checkpoint stall
        stalled = n * m.stall_s + (rem - m.interval_s)
        work = (n + 1) * m.interval_s
    else:
        stalled = n * m.stall_s
        work = n * m.interval_s + rem
    # Checkpoint k's stall ends at k*period; it is durable persist_s later.
    durable = min(n, int(max(length - m.persist_s, 0.0) // period)) if length >= m.persist_s else 0
    kept = durable * m.interval_s
    return kept, work - kept, stalled, n


def clean_segment(length: float, m: JobModel) -> tuple[float, float, int]:
    """A running stretch that ends without a fault (planned stop or the horizon): (work, stalled, checkpoints)."""
    period = m.interval_s + m.stall_s
    n = int(length // period)
    rem = length - n * period
    stalled = n * m.stall_s + max(rem - m.interval_s, 0.0)
    return length - stalled, stalled, n


def sample_trace(m: JobModel, rng: np.random.Generator) -> tuple[list[float], list[int], list[float]]:
    """The failure trace: event times, their cause index (-1 = planned stop) and per-fault repair times.

    Both recovery models draw exactly this from ``rng`` first, so equal seeds give them the same trace."""
    T = m.horizon_s
    total = m.total_rate_s
    k = int(rng.poisson(total * T)) if total > 0 else 0
    fail_t = np.sort(rng.uniform(0.0, T, k))
    fail_c = rng.choice(len(m.cause_names), size=k, p=m.cause_rate_s / total) if k else np.zeros(0, dtype=np.int64)
    repairs = rng.exponential(m.repair_mean_s, size=k) if m.repair_mean_s > 0 else np.zeros(k)
    # Planned stops mid-way through each maintenance period (47 in Llama 3's 54 days, not 46).
    maint_t = (np.arange(int(T // m.maint_interval_s) + 1) + 0.5) * m.maint_interval_s if m.maint_interval_s > 0 \
        else np.zeros(0)
    maint_t = maint_t[maint_t < T]
    times = np.concatenate([fail_t, maint_t])
    kinds = np.concatenate([fail_c, np.full(len(maint_t), -1, dtype=np.int64)])
    order = np.argsort(times, kind="stable")
    return times[order].tolist(), kinds[order].tolist(), repairs.tolist()


class Stretch:
    """The job running since ``start``: its training clock (``tau``, which the checkpoint cadence
    follows), the away share integrated over it (``deg``), and stalls of the survivors still ahead."""

    def __init__(self, start: float) -> None:
        self.last = start
        self.tau = 0.0
        self.deg = 0.0
        self.stalls: list[list] = []          # [bucket, start, end], sorted and disjoint

    def add_stall(self, bucket: int, start: float, seconds: float, after_others: bool) -> tuple[float, float]:
        """A stall from ``start``; ``after_others``: it begins when the stalls already ahead end (else it
        runs concurrently with them and only its overhang counts)."""
        prev = self.stalls[-1][2] if self.stalls else -math.inf
        s = max(start, prev)
        e = s + seconds if after_others else start + seconds
        if e > s:
            self.stalls.append([bucket, s, e])
        return s, e

    def advance(self, t: float, away_share: float, sec: list[float]) -> None:
        """Account wall time up to ``t``: stalls into their buckets, the rest to the training clock."""
        while self.stalls and self.stalls[0][1] < t:
            b, s, e = self.stalls[0]
            if s > self.last:
                self._train(s - self.last, away_share)
                self.last = s
            end = min(e, t)
            sec[b] += end - self.last
            self.last = end
            if e <= t:
                self.stalls.pop(0)
            else:
                break
        if t > self.last:
            self._train(t - self.last, away_share)
            self.last = t

    def _train(self, dt: float, away_share: float) -> None:
        self.tau += dt
        self.deg += dt * away_share

    def close(self, m: JobModel, sec: list[float], fault: bool) -> int:
        """End the stretch (by a whole-job fault or cleanly); returns the checkpoints it took."""
        share = self.deg / self.tau if self.tau > 0 else 0.0
        if fault:
            kept, lost, stalled, n = fault_segment(self.tau, m)
        else:
            kept, stalled, n = clean_segment(self.tau, m)
            lost = 0.0
        sec[PRODUCTIVE] += kept * (1.0 - share)
        sec[LOST] += lost * (1.0 - share)
        sec[DEGRADED] += (kept + lost) * share
        sec[CHECKPOINT] += stalled
        return n


def note_down(log: list[tuple[float, float]], start: float, end: float) -> None:
    if log and log[-1][1] > start:
        log[-1] = (log[-1][0], max(log[-1][1], end))
    else:
        log.append((start, end))


def simulate_once(m: JobModel, rng: np.random.Generator, keep_timeline: bool = False) -> RepResult:
    """Simulate ``m.horizon_s`` seconds of one job; all randomness comes from ``rng``."""
    T = m.horizon_s
    times, kinds, repairs = sample_trace(m, rng)
    R = m.groups
    hit = rng.integers(R, size=len(times)).tolist() if R > 1 else []     # the group a fault lands in
    wide = m.job_wide.tolist() if m.job_wide is not None else [True] * len(m.cause_names)
    detect = m.detect_s.tolist()
    hw = m.hardware.tolist()

    sec = [0.0] * len(BUCKETS)
    counts = [0] * len(m.cause_names)
    planned = checkpoints = local = 0
    spares = m.spare_hosts
    in_repair: list[float] = []          # heap of times hosts come back from repair
    phases: list[tuple[int, float, float]] = []   # the current whole-job downtime, split into buckets
    up_at = 0.0                          # when the whole job (re)starts running
    run = Stretch(0.0)
    away: dict[int, float] = {}          # group -> when it is ready to rejoin
    hosts_ready: dict[int, float] = {}   # group -> when its replacement host is in place
    returns: list[tuple[float, int, int]] = []   # heap of (ready, group, version)
    version: dict[int, int] = {}
    hosts_wait = 0.0                     # a whole-job restart waits until then for replacement hosts
    down_log: list[tuple[float, float]] = []
    r_i = e_i = 0

    def take_host(fault_t: float, at: float) -> float:
        """A hardware fault at ``fault_t``, noticed at ``at``: queue the failed host for repair and take a
        spare; returns when one is there (a spare now, or the earliest repair)."""
        nonlocal spares, r_i
        heapq.heappush(in_repair, fault_t + repairs[r_i])
        r_i += 1
        while in_repair and in_repair[0] <= at:          # repaired hosts rejoin the pool
            heapq.heappop(in_repair)
            spares += 1
        if spares > 0:
            spares -= 1
            return at
        return max(at, heapq.heappop(in_repair))         # the earliest repair (possibly the failed host)

    while e_i < len(times) or returns:
        if returns and (e_i == len(times) or returns[0][0] < times[e_i]):
            t, g, v = heapq.heappop(returns)
            if t >= T:
                break
            if version[g] != v:
                continue                 # the group failed again before it was back
            run.advance(t, len(away) / R, sec)
            del away[g]
            hosts_ready.pop(g, None)
            s, e = run.add_stall(REGROUP, t, m.regroup_s + m.transfer_s, True)
            if keep_timeline:
                note_down(down_log, s, e)
            continue
        t, kind = times[e_i], kinds[e_i]
        e_i += 1
        if kind >= 0:
            counts[kind] += 1
            if t >= up_at and R > 1 and not wide[kind] and (hit[e_i - 1] in away or len(away) < R - 1):
                g = hit[e_i - 1]         # one group stops; the others go on
                local += 1
                run.advance(t, len(away) / R, sec)
                d = detect[kind]
                if g not in away:        # the survivors wait in the exchange until the fault is noticed
                    s, _ = run.add_stall(DETECTION, t, d, False)
                    _, e = run.add_stall(REGROUP, t + d, m.regroup_s, True)
                    if keep_timeline:
                        note_down(down_log, s, e)
                clock = max(t + d, hosts_ready.get(g, 0.0))
                if hw[kind]:
                    clock = hosts_ready[g] = max(clock, take_host(t, t + d) + m.swap_s)
                clock += m.group_restart_s
                version[g] = version.get(g, 0) + 1
                away[g] = clock
                heapq.heappush(returns, (clock, g, version[g]))
                continue
        if t >= up_at:                   # the job was running: close its stretch
            for b, s, e in phases:
                sec[b] += e - s
            run.advance(t, len(away) / R, sec)
            checkpoints += run.close(m, sec, fault=kind >= 0)
            start = t
        else:                            # a new event during recovery: recovery starts over
            for b, s, e in phases:
                if s < t:
                    sec[b] += min(e, t) - s
            start = t
        waiting = dict(hosts_ready)      # groups away for a replacement host
        away.clear()
        hosts_ready.clear()
        returns.clear()
        phases = []
        clock = start
        if kind < 0:
            planned += 1
            if t >= up_at:               # save before stopping (only if it was running)
                phases.append((CHECKPOINT, clock, clock + m.final_save_s))
                clock += m.final_save_s
            phases.append((MAINTENANCE, clock, clock + m.maint_downtime_s))
            clock += m.maint_downtime_s
        else:
            d = detect[kind]
            phases.append((DETECTION, clock, clock + d))
            clock += d
            if hw[kind]:
                back = take_host(t, clock)
                if back > clock:
                    phases.append((SPARE_WAIT, clock, back))
                    clock = back
                phases.append((RESTART, clock, clock + m.swap_s))
                clock += m.swap_s
                hosts_wait = max(hosts_wait, clock)
        if hosts_wait > clock:
            phases.append((SPARE_WAIT, clock, hosts_wait))
            clock = hosts_wait
        for g, ready in waiting.items():  # still without a host: restart without it, it rejoins later
            if ready > clock:
                hosts_ready[g] = ready
                version[g] += 1
                away[g] = max(ready + m.group_restart_s, clock + m.restart_s)
                heapq.heappush(returns, (away[g], g, version[g]))
        phases.append((RESTART, clock, clock + m.restart_s))
        clock += m.restart_s
        up_at = clock
        run = Stretch(up_at)
        if keep_timeline:
            if down_log and down_log[-1][1] > start:
                down_log[-1] = (down_log[-1][0], up_at)
            else:
                down_log.append((start, up_at))

    # The horizon: close whatever state the job is in.
    if T >= up_at:
        for b, s, e in phases:
            sec[b] += e - s
        run.advance(T, len(away) / R, sec)
        checkpoints += run.close(m, sec, fault=False)
    else:
        for b, s, e in phases:
            if s < T:
                sec[b] += min(e, T) - s
    if keep_timeline and down_log:
        down_log[-1] = (down_log[-1][0], min(down_log[-1][1], T))
    return RepResult(np.asarray(sec), np.asarray(counts), planned, checkpoints, down_log, local)


def checkpoint_cost(m: JobModel) -> float:
    """Seconds a checkpoint costs the critical path (for Young/Daly)."""
    return m.stall_s


def mean_downtime_s(m: JobModel) -> float:
    """Rate-weighted mean downtime of a whole-job rollback, assuming a spare is available."""
    rates = m.rollback_rate_s
    if rates.sum() <= 0:
        return m.restart_s
    w = rates / rates.sum()
    return float((w * (m.detect_s + m.hardware * m.swap_s)).sum() + m.restart_s)
