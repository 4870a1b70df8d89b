"""The ``[fault]`` section: fault injection and chaos, validated when the config loads."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

from stalwart.config.core import ConfigError, option
from stalwart.config.fault_plan import CHAOS_KINDS, FaultPlanError, parse_plan


def validate_timeouts(heartbeat_interval_s: float, heartbeat_timeout_s: float, progress_timeout_s: float,
                      collective_timeout_s: float, init_timeout_s: float) -> None:
    """Each detector must fire before the mechanism behind it would: a clear error otherwise."""
    chain = [("fault.heartbeat_interval_s", heartbeat_interval_s), ("fault.heartbeat_timeout_s", heartbeat_timeout_s),
             ("fault.progress_timeout_s", progress_timeout_s), ("fault.collective_timeout_s", collective_timeout_s),
             ("fault.init_timeout_s", init_timeout_s)]
    for (a, va), (b, vb) in itertools.pairwise(chain):
        if not va < vb:
            raise ConfigError(
                f"{a} ({va:g} s) must be smaller than {b} ({vb:g} s): the timeouts must be ordered "
                "heartbeat interval < heartbeat timeout < progress timeout < collective timeout < init timeout, "
                "so a hang is caught by the watchdog before torch's collective timeout turns it into a crash")


@dataclass
class FaultConfig:
    inject: str = option("Fault-injection plan for tests and drills, e.g. 'kill:rank=1,step=17;hang:rank=0,step=30;"
                         "nan:step=40;slow:rank=1,factor=3,steps=50-80;exception:rank=0,step=60;"
                         "corrupt_checkpoint:step=50'. Each fault fires once (recorded in <run>/ft/fired/); "
                         "'once=0' repeats it on every attempt. '' = none.", "")
    chaos_mtbf_s: float = option("Chaos drill: the supervisor injects random faults (fault.chaos_kinds) into random "
                                 "ranks with this mean time between failures in seconds (0 = off).", 0.0, min=0.0)
    chaos_seed: int = option("Seed of the chaos schedule (equal seeds give equal fault times, kinds and ranks).",
                             0, min=0)
    chaos_kinds: list[str] = option("Fault kinds chaos draws from: kill (SIGKILL), hang (SIGSTOP), exception "
                                    "(SIGUSR2 raises in the worker).", factory=lambda: ["kill", "hang", "exception"])
    heartbeat_interval_s: float = option("Each rank's heartbeat thread writes <run>/ft/heartbeat/rank-<r>.json this "
                                         "often.", 0.5, min=0.01)
    heartbeat_timeout_s: float = option("A rank whose heartbeat is older than this is unresponsive: the supervisor "
                                        "kills and restarts the group.", 10.0, min=0.01)
    progress_timeout_s: float = option("A rank that completes no step for this long (stuck in a collective or in "
                                       "compute) is hung: the group is killed and restarted. Must exceed the "
                                       "longest step, evaluation and checkpoint stall.", 120.0, min=0.01)
    collective_timeout_s: float = option("Process-group timeout of every collective (torch's default is 30 min); "
                                         "a backstop behind the progress watchdog.", 300.0, min=0.01)
    init_timeout_s: float = option("Start-up (rendezvous, building, resume) until the first step completes, and "
                                   "the end of training (final eval/checkpoint), may take this long.", 900.0,
                                   min=0.01)
    kill_grace_s: float = option("After SIGTERM to a hung group, wait this long before SIGKILL.", 2.0, min=0.0)
    monitor_interval_s: float = option("How often the supervisor polls worker exit codes and heartbeats.", 0.1,
                                       min=0.01)
    crash_loop_restarts: int = option("Stop with exit code 76 ('do not requeue') after this many failures in a row "
                                      "with no progress (the newest snapshot/checkpoint step did not advance); "
                                      "0 = never.", 3, min=0)
    exclude_after: int = option("Exclude a host after this many failures attributed to it (0 = never): the job "
                                "restarts without it, on fewer data-parallel ranks with the same global batch "
                                "(more gradient accumulation), and records it in <run>/ft/excluded.json.", 0,
                                min=0)
    spare_hosts: int = option("Spare hosts in reserve: while any remain, an excluded host is replaced by one "
                              "(same world size, so the same trajectory) instead of shrinking the job. On one "
                              "machine the spare is local capacity; across nodes, start standby nodes in "
                              "torchrun's elastic range (--nnodes MIN:MAX).", 0, min=0)
    host_size: int = option("Ranks per host for exclusion (0 = launch.nproc_per_node, i.e. a real host; tests "
                            "use 1 so one local process stands for a host).", 0, min=0)
    nonfinite: Literal["skip", "rollback", "off"] = option(
        "Non-finite loss or gradients on any rank: 'skip' the step on every rank (weights and optimizer state, "
        "AdamW step counters included, unchanged), 'rollback' to the last good state skipping that step, or 'off'.",
        "skip")
    spike_zscore: float = option("Loss spike: a loss whose robust z-score (median/MAD over fault.spike_window "
                                 "steps) exceeds this rolls back to the last good state and skips the offending "
                                 "steps (needs the supervisor's restarts, see launch.max_restarts; otherwise only reported). 0 = off; 8 is a "
                                 "reasonable start.", 0.0, min=0.0)
    spike_window: int = option("Trailing steps the loss-spike statistics use (it needs half of them first).", 32,
                               min=4)
    spike_skip_steps: int = option("Steps of data skipped after a spike, ending at the spike step.", 1, min=1)
    straggler_threshold: float = option("A rank whose median forward/backward time over fault.straggler_window "
                                        "steps is this many times its peers' is reported as a straggler (0 = off).",
                                        2.0, min=0.0)
    straggler_window: int = option("Steps the straggler detector looks at.", 8, min=2)
    straggler_policy: Literal["report", "exclude"] = option(
        "'report' = straggler event and summary line; 'exclude' = also record the rank's host in "
        "<run>/ft/excluded.json for the next launch.", "report")

    group_recovery: bool = option(
        "Each data-parallel replica group (parallelism.dp_replicate = R >= 2, each of the processes / R ranks) "
        "fails and recovers on its own: the other groups keep running and redo a lost group's micro-batches in "
        "the same step, bit for bit (needs training.elastic_exact), and the restarted group rejoins by a live "
        "transfer from a healthy one (docs/fault-tolerance.md, 'Train through a fault').", False)
    rejoin_timeout_s: float = option("A lost replica group that has not rejoined within this many seconds, or a "
                                     "whole-job start whose groups do not all register in it, goes on without "
                                     "them (group_recovery).", 120.0, min=0.1)
    lighthouse: str = option("HOST:PORT of the quorum store of the replica groups (group_recovery). Set by the "
                             "launcher; across hosts give an address of the private cluster network.", "")
    replica_group: int = option("This process's replica group (group_recovery; set by the launcher, -1 = none).",
                                -1, min=-1)

    def __post_init__(self) -> None:
        validate_timeouts(self.heartbeat_interval_s, self.heartbeat_timeout_s, self.progress_timeout_s,
                          self.collective_timeout_s, self.init_timeout_s)
        parse_plan(self.inject)
        bad = [k for k in self.chaos_kinds if k not in CHAOS_KINDS]
        if bad:
            raise FaultPlanError(f"fault.chaos_kinds: {bad[0]!r} is not one of {', '.join(CHAOS_KINDS)}")
