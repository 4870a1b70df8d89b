"""``stalwart train`` with more than one process, or under supervision: check the job before any
process starts, then run the workers under the supervisor; relaunch without an excluded host."""

from __future__ import annotations

import os
import sys

from stalwart.config.job import JobConfig
from stalwart.ft.detect import EXIT_EXCLUDE
from stalwart.ft.records import read_exclusions
from stalwart.launch.agent import run_supervised
from stalwart.launch.preflight import preflight
from stalwart.metrics.records import EventLog
from stalwart.parallel.dims import LayoutError, ParallelDims
from stalwart.paths import RunPaths
from stalwart.ft.runlock import LOCK_HOLDER_ENV, RunLock


def shrink_record(cfg: JobConfig, before: int, after: int) -> dict:
    """What a shrink from ``before`` to ``after`` processes keeps and changes, for the ``excluded`` event (and
    one line on stderr): the global batch is kept, each data-parallel rank accumulates more micro-batches,
    and with ``training.elastic_exact`` the run goes on bit for bit (parallel/elastic.py)."""
    leaves = cfg.training.global_batch // cfg.training.micro_batch
    dp = {n: ParallelDims.resolve(cfg.parallelism, n).dp for n in (before, after)}
    rec = {"shrunk_from": before, "global_batch": cfg.training.global_batch,
           "micro_batches_per_rank": [leaves // dp[before], leaves // dp[after]],
           "elastic_exact": cfg.training.elastic_exact, "bitwise": cfg.training.elastic_exact}
    how = ("bit for bit (training.elastic_exact)" if cfg.training.elastic_exact else
           "NOT bit for bit: the gradient sum's order changes with the number of ranks (set "
           "training.elastic_exact to keep every bit)")
    print(f"stalwart supervisor: no spare host left: shrinking {before} -> {after} processes, global batch "
          f"{cfg.training.global_batch} kept ({rec['micro_batches_per_rank'][1]} micro-batches per rank); {how}",
          file=sys.stderr, flush=True)
    return rec


def supervised(cfg: JobConfig) -> bool:
    """Whether one process runs under the supervisor (several always do)."""
    return cfg.launch.max_restarts > 0 or bool(cfg.fault.inject) or cfg.fault.chaos_mtbf_s > 0


def launch(argv: list[str], nproc: int, cfg: JobConfig) -> int:
    """Start ``nproc`` workers (``-m stalwart.train argv``) under the supervisor; return the exit code."""
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.launch.threads(nproc)))
    paths = RunPaths.of(cfg.run)
    snap = paths.snapshots(cfg.checkpoint.memory_dir) if cfg.checkpoint.memory_interval else None
    with RunLock(paths):  # one run per directory, for the whole job (restarts and relaunches included)
        os.environ[LOCK_HOLDER_ENV] = str(os.getpid())
        return _launch_loop(argv, nproc, cfg, paths, snap)


def _launch_loop(argv: list[str], nproc: int, cfg: JobConfig, paths: RunPaths, snap) -> int:
    budget, spares = cfg.launch.restarts(), cfg.fault.spare_hosts
    while True:
        # The workers' config records how many processes ran, so <run>/config.toml relaunches the same job.
        code = run_supervised(["--standalone", f"--nproc-per-node={nproc}", "--module", "stalwart.train", *argv,
                               "--launch.nproc_per_node", str(nproc)],
                              cfg.fault, paths, snap, budget, cfg.launch.fork_workers)
        if code != EXIT_EXCLUDE:
            return code
        # A host was excluded (fault.exclude_after): continue on the rest, same global batch.
        ex = read_exclusions(paths)[-1]
        budget = max(0, budget - ex["restarts_used"] - 1)
        log = EventLog(paths.events)
        try:
            if spares > 0:  # a spare host takes the excluded one's place: same world size, same trajectory
                spares -= 1
                log("spare_adopted", host=ex["host"], ranks=ex["ranks"], nproc_per_node=nproc, spares_left=spares,
                    remaining_restarts=budget)
                continue
            nproc -= ex["size"]
            if nproc < 1:
                raise LayoutError("fault.exclude_after: every host has been excluded; nothing left to train on")
            preflight(cfg, nproc)  # the global batch must still split into the smaller data-parallel degree
            log("excluded", host=ex["host"], ranks=ex["ranks"], nproc_per_node=nproc, remaining_restarts=budget,
                **shrink_record(cfg, nproc + ex["size"], nproc))
        finally:
            log.close()
