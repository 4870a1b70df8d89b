"""One replication of a long job: interruptions, recovery and checkpoints, event by event.

The job runs on a fixed set of hosts; unplanned interruptions arrive as a Poisson process (the
superposition of every cause's process over every GPU/host in the job) on the wall clock, so a
fault during a restart restarts the recovery. Between interruptions the checkpoint cadence is
handled in closed form (no event per checkpoint), which keeps a 54-day, 16k-GPU replication at a
few hundred loop iterations.

Time is classified into: productive (work later kept), lost (work since the last durable
checkpoint, thrown away by a fault), detection, restart (re-initialise + restore), spare_wait (no
spare host left: wait for a repair), checkpoint (stalls to save), maintenance (planned downtime).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

BUCKETS = ("productive", "lost", "detection", "restart", "spare_wait", "checkpoint", "maintenance")
PRODUCTIVE, LOST, DETECTION, RESTART, SPARE_WAIT, CHECKPOINT, MAINTENANCE = range(len(BUCKETS))


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

    @property
    def total_rate_s(self) -> float:
        return float(self.cause_rate_s.sum())


@dataclass
class RepResult:
    seconds: np.ndarray                   # (len(BUCKETS),) wall seconds per bucket; sums to the horizon
    cause_counts: np.ndarray              # (causes,) unplanned interruptions
    planned: int
    checkpoints: int
    down_intervals: list[tuple[float, float]] = field(default_factory=list)  # for power and plots

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


def simulate_once(m: JobModel, rng: np.random.Generator, keep_timeline: bool = False) -> RepResult:
    """Simulate ``m.horizon_s`` seconds of one job; all randomness comes from ``rng``."""
    T = m.horizon_s
    n_causes = len(m.cause_names)
    total = m.total_rate_s
    k = int(rng.poisson(total * T)) if total > 0 else 0
    fail_t = np.sort(rng.uniform(0.0, T, k))
    fail_c = rng.choice(n_causes, size=k, p=m.cause_rate_s / total) if k else np.zeros(0, dtype=np.int64)
    repairs = rng.exponential(m.repair_mean_s, size=k) if m.repair_mean_s > 0 else np.zeros(k)
    # Planned stops mid-way through each maintenance period (47 in Llama 3's 54 days, not 46).
    maint_t = (np.arange(int(T // m.maint_interval_s) + 1) + 0.5) * m.maint_interval_s if m.maint_interval_s > 0 \
        else np.zeros(0)
    maint_t = maint_t[maint_t < T]

    # Merge both streams: (time, cause index or -1 for planned).
    times = np.concatenate([fail_t, maint_t])
    kinds = np.concatenate([fail_c, np.full(len(maint_t), -1, dtype=np.int64)])
    order = np.argsort(times, kind="stable")
    times, kinds = times[order].tolist(), kinds[order].tolist()
    repairs = repairs.tolist()
    detect = m.detect_s.tolist()
    hw = m.hardware.tolist()

    sec = [0.0] * len(BUCKETS)
    counts = [0] * n_causes
    planned = checkpoints = 0
    spares = m.spare_hosts
    in_repair: list[float] = []          # heap of times hosts come back from repair
    phases: list[tuple[int, float, float]] = []   # the current downtime, split into buckets
    up_at = 0.0                          # when the job (re)starts running
    down_log: list[tuple[float, float]] = []
    r_i = 0

    for t, kind in zip(times, kinds):
        if t >= up_at:                   # the job was running: close its stretch
            for b, s, e in phases:
                sec[b] += e - s
            length = t - up_at
            if kind < 0:
                work, stalled, n = clean_segment(length, m)
                sec[PRODUCTIVE] += work
                sec[CHECKPOINT] += stalled
            else:
                kept, lost, stalled, n = fault_segment(length, m)
                sec[PRODUCTIVE] += kept
                sec[LOST] += lost
                sec[CHECKPOINT] += stalled
            checkpoints += n
            start = t
        else:                            # a new event during recovery: recovery starts over
            for b, s, e in phases:
                if s < t:
                    sec[b] += min(e, t) - s
            start = t
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
            counts[kind] += 1
            d = detect[kind]
            phases.append((DETECTION, clock, clock + d))
            clock += d
            if hw[kind]:
                heapq.heappush(in_repair, t + repairs[r_i])
                r_i += 1
                while in_repair and in_repair[0] <= clock:   # repaired hosts rejoin the pool
                    heapq.heappop(in_repair)
                    spares += 1
                if spares > 0:
                    spares -= 1
                else:                    # wait for the earliest repair (possibly the failed host itself)
                    back = heapq.heappop(in_repair)
                    if back > clock:
                        phases.append((SPARE_WAIT, clock, back))
                        clock = back
                phases.append((RESTART, clock, clock + m.swap_s))
                clock += m.swap_s
        phases.append((RESTART, clock, clock + m.restart_s))
        clock += m.restart_s
        up_at = clock
        if keep_timeline:
            if down_log and down_log[-1][1] > start:
                down_log[-1] = (down_log[-1][0], up_at)
            else:
                down_log.append((start, up_at))

    # The horizon: close whatever state the job is in.
    if T >= up_at:
        for b, s, e in phases:
            sec[b] += e - s
        work, stalled, n = clean_segment(T - up_at, m)
        sec[PRODUCTIVE] += work
        sec[CHECKPOINT] += stalled
        checkpoints += n
    else:
        for b, s, e in phases:
            if s < T:
                sec[b] += min(e, T) - s
        if keep_timeline and down_log:
            down_log[-1] = (down_log[-1][0], min(down_log[-1][1], T))
    return RepResult(np.asarray(sec), np.asarray(counts), planned, checkpoints, down_log)


def checkpoint_cost(m: JobModel) -> float:
    """Seconds a checkpoint costs the critical path (for Young/Daly)."""
    return m.stall_s


def mean_downtime_s(m: JobModel) -> float:
    """Rate-weighted mean downtime of an unplanned interruption, assuming a spare is available."""
    if m.total_rate_s <= 0:
        return m.restart_s
    w = m.cause_rate_s / m.total_rate_s
    return float((w * (m.detect_s + m.hardware * m.swap_s)).sum() + m.restart_s)
