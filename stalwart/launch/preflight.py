"""Check a training job before any process starts (one clear line, exit 2): the layout, the model it
splits, the data, the global batch; then, with torch, the device and a resumed run's checkpoint shape.

Imports nothing heavy until the checks that need torch, which come last: ``stalwart train`` with a data
path that does not exist or a layout that does not divide the world size answers in a fraction of a
second (``tests/test_cli_startup.py``).
"""

from __future__ import annotations

import os

from stalwart.config.job import JobConfig
from stalwart.data.corpus import Corpus
from stalwart.data.mixture import parse_mix
from stalwart.data.prepared import is_prepared, open_prepared
from stalwart.data.tokenizer import load_tokenizer
from stalwart.models.flavors import resolve_args
from stalwart.parallel.dims import LayoutError, ParallelDims, virtual_stages
from stalwart.parallel.regroup import check_groups
from stalwart.paths import RunPaths


def preflight(cfg: JobConfig, nproc: int) -> None:
    """Catch layout and data mistakes before any process is started (one clear line, exit 2)."""
    world = int(os.environ.get("WORLD_SIZE", nproc))
    if cfg.fault.group_recovery and cfg.fault.replica_group >= 0:  # one replica group of the job on this host
        world = nproc * cfg.parallelism.dp_replicate
    islands = cfg.parallelism.islands
    if islands > 1:  # the layout is an island's: its own processes
        if cfg.fault.replica_group < 0 and nproc % islands:
            raise LayoutError(f"parallelism.islands: {nproc} processes do not split into {islands} islands")
        world = nproc if cfg.fault.replica_group >= 0 else nproc // islands
    dims = ParallelDims.resolve(cfg.parallelism, world)
    if islands > 1 and world > 1 and (dims.dp_shard > 1 or dims.tp * dims.pp * dims.cp * dims.ep > 1):
        raise LayoutError("parallelism.islands: every rank of an island holds the whole model for now (its ranks "
                          f"replicate: {dims.describe()} was asked); set --parallelism.data_parallel replicate")
    paths = RunPaths.of(cfg.run)
    vocab = load_tokenizer(paths.tokenizer).get_vocab_size() if paths.tokenizer.is_file() else 256
    args = resolve_args(cfg.model, vocab, cfg.data.seq_len)
    dims.check_model(args.n_heads, args.n_kv_heads, args.n_layers, cfg.data.seq_len,
                     virtual_stages(cfg.parallelism, dims), args.moe.n_experts if args.moe else 0)
    if is_prepared(cfg.data.path):
        data = open_prepared(cfg.data.path)
        data.verify(full=False)
        if cfg.data.mix:
            parse_mix(cfg.data.mix, data.names)
    else:
        Corpus(cfg.data.path, cfg.data.format, cfg.data.text_field, cfg.data.val_fraction, cfg.data.decode_errors,
               cfg.data.max_mb)
    if cfg.fault.group_recovery:
        _check_groups(cfg, world)
    batch = cfg.training.global_batch // max(islands, 1)  # an island's share
    per_rank = batch // dims.dp if batch % dims.dp == 0 else None
    if per_rank is None or per_rank % cfg.training.micro_batch:
        raise LayoutError(
            f"training.global_batch ({cfg.training.global_batch}) must split into {islands} island(s) x {dims.dp} "
            "data-parallel ranks x "
            f"whole micro-batches of {cfg.training.micro_batch}; e.g. set --training.global_batch "
            f"{islands * dims.dp * cfg.training.micro_batch}")
    # With torch from here on.
    from stalwart.runtime.device import check_device
    from stalwart.train.checkpointer import Checkpointer

    check_device(cfg.training.device, nproc, "training.device")
    if paths.tokenizer.is_file():  # a run to resume: its checkpoint must fit the config's model
        Checkpointer.refuse_other_shape(cfg.checkpoint, paths, args)


def _check_groups(cfg: JobConfig, world: int) -> None:
    """``fault.group_recovery``: the processes split into whole replica groups of whole replicas."""
    p, groups = cfg.parallelism, cfg.parallelism.dp_replicate
    if world % groups:
        raise LayoutError(f"fault.group_recovery: {world} processes do not split into {groups} replica groups "
                          "(parallelism.dp_replicate)")
    if p.dp_shard not in (-1, 1) or p.tp * p.pp * p.cp * p.ep > 1:
        raise LayoutError("fault.group_recovery: every rank of a replica group holds the whole model for now "
                          "(dp_shard, tp, pp, cp and ep must be 1)")
    check_groups(cfg.training.global_batch // cfg.training.micro_batch, groups, world // groups)
