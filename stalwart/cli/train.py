"""`stalwart train`: validate the config, then run one worker in-process or launch N via torchrun.

Multi-node jobs use standard torchrun rendezvous instead of --nproc-per-node:
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        -m stalwart.train --config llama3_8b
"""

from __future__ import annotations

import os

from stalwart.config.loading import job_help, load_job, split_args
from stalwart.train.worker import LAUNCHER_FLAGS, worker_main

INTRO = """usage: stalwart train [--config FILE_OR_NAME] [--nproc-per-node N] [--section.key VALUE ...]

Train a model. With --nproc-per-node N > 1 (or launch.nproc_per_node in the config) the workers are
started through torch's elastic launcher; under torchrun, use `torchrun ... -m stalwart.train ...`.
Re-running on an existing run.dir with checkpoint.resume = auto continues from its newest complete
checkpoint and appends to its metrics.jsonl."""


def preflight(cfg, nproc: int) -> None:
    """Catch layout and data mistakes before any process is started (one clear line, exit 2)."""
    from stalwart.data.corpus import Corpus
    from stalwart.models.flavors import resolve_args
    from stalwart.parallel.dims import ParallelDims, virtual_stages

    world = int(os.environ.get("WORLD_SIZE", nproc))
    dims = ParallelDims.resolve(cfg.parallelism, world)
    args = resolve_args(cfg.model, 256, cfg.data.seq_len)
    dims.check_model(args.n_heads, args.n_kv_heads, args.n_layers, cfg.data.seq_len,
                     virtual_stages(cfg.parallelism, dims))
    Corpus(cfg.data.path, cfg.data.format, cfg.data.text_field, cfg.data.val_fraction)
    per_rank = cfg.training.global_batch // dims.dp if cfg.training.global_batch % dims.dp == 0 else None
    if per_rank is None or per_rank % cfg.training.micro_batch:
        from stalwart.parallel.dims import LayoutError

        raise LayoutError(
            f"training.global_batch ({cfg.training.global_batch}) must split into {dims.dp} data-parallel ranks x "
            f"whole micro-batches of {cfg.training.micro_batch}; e.g. set --training.global_batch "
            f"{dims.dp * cfg.training.micro_batch}")


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(job_help("train", INTRO))
        return 0
    opts, overrides = split_args(argv, LAUNCHER_FLAGS)
    cfg = load_job(opts.get("--config"), overrides)  # type: ignore[arg-type]
    from stalwart.train.dist_env import launched_by_torchrun

    if launched_by_torchrun():
        return worker_main(argv)
    nproc = int(opts.get("--nproc-per-node") or opts.get("--nproc_per_node") or cfg.launch.nproc_per_node)
    preflight(cfg, nproc)
    supervised = cfg.launch.max_restarts > 0 or cfg.fault.inject or cfg.fault.chaos_mtbf_s > 0
    if nproc == 1 and not supervised:
        return worker_main(argv)
    return launch(argv, nproc, cfg)


def launch(argv: list[str], nproc: int, cfg) -> int:
    """Start the workers under Stalwart's supervisor (torch's elastic agent + fault tolerance)."""
    from pathlib import Path

    from stalwart.checkpoint.snapshot import default_snapshot_dir
    from stalwart.ft.agent import read_exclusions, run_supervised
    from stalwart.ft.detect import EXIT_EXCLUDE
    from stalwart.metrics.records import EventLog
    from stalwart.parallel.dims import LayoutError
    from stalwart.train.trainer import run_dir_for
    from stalwart.train.worker import threads_for

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_for(cfg, nproc)))
    run_dir = run_dir_for(cfg)
    snap = Path(cfg.checkpoint.memory_dir) if cfg.checkpoint.memory_dir else default_snapshot_dir(run_dir)
    budget, spares = cfg.launch.max_restarts, cfg.fault.spare_hosts
    while True:
        code = run_supervised(["--standalone", f"--nproc-per-node={nproc}", "--module", "stalwart.train", *argv],
                              cfg.fault, run_dir, snap if cfg.checkpoint.memory_interval else None, budget)
        if code != EXIT_EXCLUDE:
            return code
        # A host was excluded (fault.exclude_after): continue on the rest, same global batch.
        ex = read_exclusions(run_dir)[-1]
        budget = max(0, budget - ex["restarts_used"] - 1)
        if spares > 0:  # a spare host takes the excluded one's place: same world size, same trajectory
            spares -= 1
            log = EventLog(run_dir / "events.jsonl")
            log("spare_adopted", host=ex["host"], ranks=ex["ranks"], nproc_per_node=nproc, spares_left=spares,
                remaining_restarts=budget)
            log.close()
            continue
        nproc -= ex["size"]
        if nproc < 1:
            raise LayoutError("fault.exclude_after: every host has been excluded; nothing left to train on")
        preflight(cfg, nproc)  # the global batch must still split into the smaller data-parallel degree
        log = EventLog(run_dir / "events.jsonl")
        log("excluded", host=ex["host"], ranks=ex["ranks"], nproc_per_node=nproc, remaining_restarts=budget)
        log.close()
