"""Several jobs sharing one cluster: queueing, topology-aware placement, failures and a spare pool.

Hosts are allocated whole, so a job's tensor-parallel groups (<= 8 GPUs) always sit inside one
host's NVLink domain. The topology-aware placement then keeps a job in as few racks as possible:
best-fit into a single rack when one has room, else the emptiest racks first. The random placement
is the baseline it is compared with. A running job's host failure costs it a restart and half a
checkpoint interval of work on average; a spare host takes the failed one's slot (NOTE: spares are
modelled as a count, assumed spread over racks, so a swap never changes a job's rack footprint).
Each rack a job spans beyond the fewest possible slows it by ``extra_rack_slowdown`` (its
data-parallel traffic crosses the oversubscribed aggregation layer more often): that is how
placement reaches utilisation and queueing.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

ARRIVE, FINISH, FAIL, REPAIR = range(4)


@dataclass
class Job:
    id: int
    hosts: int
    work_s: float
    submit_s: float
    start_s: float = -1.0
    end_s: float = -1.0
    alloc: dict[int, int] = field(default_factory=dict)   # rack -> hosts
    remaining_s: float = 0.0
    resumed_s: float = 0.0
    version: int = 0
    failures: int = 0
    slowdown: float = 1.0                                  # wall seconds per second of work


@dataclass(frozen=True)
class ClusterReport:
    jobs: int
    completed: int
    utilisation: float            # allocated host-time / (non-spare hosts x makespan)
    goodput_utilisation: float    # useful job work / (non-spare hosts x makespan)
    makespan_h: float
    wait_mean_h: float
    wait_p95_h: float
    wait_max_h: float
    racks_per_job: float          # mean racks a multi-host job spans
    rack_excess: float            # mean (racks spanned / fewest possible)
    failures: int
    spare_waits: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def place(free: np.ndarray, hosts: int, policy: str, rng: np.random.Generator) -> dict[int, int] | None:
    """Choose hosts from racks with ``free`` hosts each; None if they do not fit. Pure but for ``rng``."""
    if free.sum() < hosts:
        return None
    if policy == "random":
        take = rng.multivariate_hypergeometric(free.astype(np.int64), hosts)
        return {int(r): int(n) for r, n in enumerate(take) if n}
    fits = np.flatnonzero(free >= hosts)
    if len(fits):                                   # best fit: the fullest rack that still fits
        r = int(fits[np.argmin(free[fits])])
        return {r: hosts}
    alloc: dict[int, int] = {}
    need = hosts
    for r in np.argsort(-free, kind="stable"):      # emptiest racks first: fewest racks
        n = int(min(free[r], need))
        if n:
            alloc[int(r)] = n
            need -= n
        if need == 0:
            break
    return alloc


def simulate_cluster(c, gpus_per_host: int, host_fail_rate_s: float, repair_mean_s: float, restart_s: float,
                     checkpoint_interval_s: float, rng: np.random.Generator) -> ClusterReport:
    """``c`` is the ``cluster`` config section; failure/restart figures come from the job model."""
    free = np.full(c.racks, c.hosts_per_rack, dtype=np.int64)
    usable = c.racks * c.hosts_per_rack
    # The spare pool is carved out of the last racks.
    for r in range(c.racks - 1, -1, -1):
        take = min(free[r], c.spare_hosts - (usable - free.sum()))
        free[r] -= take
    usable = int(free.sum())
    spares = c.spare_hosts
    n = c.jobs
    submit = np.sort(rng.uniform(0.0, c.days * 86400.0, n))
    sizes = rng.choice(np.asarray(c.job_gpus), size=n)
    work = rng.exponential(c.mean_hours * 3600.0, size=n)
    jobs = [Job(i, math.ceil(g / gpus_per_host), float(w), float(s), remaining_s=float(w))
            for i, (g, w, s) in enumerate(zip(sizes, work, submit))]
    events: list[tuple[float, int, int, int, int]] = []   # (time, seq, kind, job, version)
    seq = 0

    def push(t: float, kind: int, job: int = -1, version: int = 0) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, job, version))
        seq += 1

    for j in jobs:
        push(j.submit_s, ARRIVE, j.id)
    queue: list[int] = []
    waiting_for_spare: list[int] = []
    busy_host_s = useful_s = 0.0
    running_hosts = 0
    last_t = 0.0
    failures = spare_waits = 0

    def run_job(j: Job, t: float, delay: float) -> None:
        j.resumed_s = t + delay
        j.version += 1
        push(j.resumed_s + j.remaining_s * j.slowdown, FINISH, j.id, j.version)
        if host_fail_rate_s > 0:
            push(t + rng.exponential(1.0 / (host_fail_rate_s * j.hosts)), FAIL, j.id, j.version)

    def schedule(t: float) -> None:
        nonlocal running_hosts
        for jid in list(queue):
            j = jobs[jid]
            alloc = place(free, j.hosts, c.placement, rng)
            if alloc is None:
                if c.policy == "fifo":
                    return
                continue
            for r, k in alloc.items():
                free[r] -= k
            j.alloc, j.start_s = alloc, t
            j.slowdown = 1.0 + c.extra_rack_slowdown * (len(alloc) - math.ceil(j.hosts / c.hosts_per_rack))
            running_hosts += j.hosts
            queue.remove(jid)
            run_job(j, t, 0.0)

    while events:
        t, _, kind, jid, version = heapq.heappop(events)
        busy_host_s += running_hosts * (t - last_t)
        last_t = t
        if kind == ARRIVE:
            queue.append(jid)
        elif kind == REPAIR:
            spares += 1
            if waiting_for_spare:
                spares -= 1
                run_job(jobs[waiting_for_spare.pop(0)], t, restart_s)
        else:
            j = jobs[jid]
            if version != j.version:
                continue                             # superseded by a failure/restart
            if kind == FINISH:
                j.end_s = t
                j.version += 1                       # its pending failure event is void
                useful_s += j.work_s * j.hosts
                for r, k in j.alloc.items():
                    free[r] += k
                running_hosts -= j.hosts
            else:                                    # FAIL: lose work since the last checkpoint
                failures += 1
                j.failures += 1
                done = max(t - j.resumed_s, 0.0) / j.slowdown
                lost = min(done, rng.uniform(0.0, checkpoint_interval_s))
                j.remaining_s -= done - lost
                j.version += 1
                push(t + rng.exponential(repair_mean_s) if repair_mean_s > 0 else t, REPAIR)
                if spares > 0:
                    spares -= 1
                    run_job(j, t, restart_s)
                else:
                    spare_waits += 1
                    waiting_for_spare.append(jid)
        schedule(t)

    done_jobs = [j for j in jobs if j.end_s >= 0]
    makespan = max((j.end_s for j in done_jobs), default=0.0)
    waits = np.array([j.start_s - j.submit_s for j in done_jobs]) / 3600.0 if done_jobs else np.zeros(1)
    multi = [j for j in done_jobs if j.hosts > 1]
    racks = np.array([len(j.alloc) for j in multi]) if multi else np.ones(1)
    ideal = np.array([math.ceil(j.hosts / c.hosts_per_rack) for j in multi]) if multi else np.ones(1)
    denom = usable * makespan if makespan > 0 else 1.0
    return ClusterReport(
        jobs=n, completed=len(done_jobs), utilisation=busy_host_s / denom, goodput_utilisation=useful_s / denom,
        makespan_h=makespan / 3600.0, wait_mean_h=float(waits.mean()), wait_p95_h=float(np.percentile(waits, 95)),
        wait_max_h=float(waits.max()), racks_per_job=float(racks.mean()), rack_excess=float((racks / ideal).mean()),
        failures=failures, spare_waits=spare_waits)
