"""Data parallel by DDP's replicate (parallel/replicate.py): the replicas stay identical, in float32 and under
the bfloat16 cast, parameter names are the model's own, and the losses match one process (gloo, spawned)."""

from __future__ import annotations

import pytest
import torch

from torch.distributed._composable.replicate import replicate

from conftest import spawn_gloo
from stalwart.config.job import CommConfig, OptimizerConfig, ParallelismConfig, SchedulerConfig, TrainingConfig
from stalwart.data.loader import Batch
from stalwart.models.flavors import TransformerArgs
from stalwart.parallel.replicate import keeps_bucket_layout
from stalwart.train.core import CoreSpec, TrainCore
from stalwart.runtime.env import DistEnv

pytestmark = pytest.mark.multiproc

ARGS = TransformerArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64, max_seq_len=16)
GLOBAL_BATCH, SEQ, STEPS = 4, 16, 4


def train(dtype: str, rank: int, world: int, bucket_mb: float = 4.0) -> dict:
    spec = CoreSpec(ARGS, ParallelismConfig(data_parallel="replicate"), CommConfig(bucket_mb=bucket_mb),
                    OptimizerConfig(lr=1e-2),
                    SchedulerConfig(warmup_steps=1),
                    TrainingConfig(steps=STEPS, global_batch=GLOBAL_BATCH, micro_batch=GLOBAL_BATCH // world,
                                   dtype=dtype), seq_len=SEQ, accum_steps=1)
    core = TrainCore.build(spec, DistEnv(rank, world, rank, world, torch.device("cpu")))
    per_rank = GLOBAL_BATCH // world
    losses = []
    for step in range(STEPS):
        x = torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        mine = x[rank * per_rank:(rank + 1) * per_rank]
        losses.append(core.train_step([Batch(mine[:, :-1], mine[:, 1:])])["loss"])
    ddp = replicate.state(core.model)._ddp if core.pm.replicated else None
    return {"replicated": core.pm.replicated, "cast": str(core.pm.cast_dtype), "losses": losses,
            "bucket_bytes": ddp.bucket_bytes_cap if ddp else None,
            "names": sorted(n for n, _ in core.model.named_parameters()),
            "params": {n: p.detach().double().sum().item() for n, p in core.model.named_parameters()},
            "bits": {n: p.detach().float().view(torch.int32).sum().item() for n, p in core.model.named_parameters()}}


def train_in_small_buckets(dtype: str, rank: int, world: int) -> dict:
    return train(dtype, rank, world, bucket_mb=0.5)


def test_replicas_stay_identical_and_match_one_process(tmp_path):
    got = dict(zip(("float32", "bfloat16"), spawn_gloo(tmp_path, 2, train_in_small_buckets, ["float32", "bfloat16"])))
    plain = sorted(n for n, _ in TrainCore.build(
        CoreSpec(ARGS, ParallelismConfig(), CommConfig(), OptimizerConfig(), SchedulerConfig(),
                 TrainingConfig(steps=1, global_batch=2, micro_batch=2), seq_len=SEQ, accum_steps=1),
        DistEnv(0, 1, 0, 1, torch.device("cpu"))).model.named_parameters())
    for dtype, (r0, r1) in got.items():
        assert r0["replicated"] and r0["names"] == plain, dtype
        assert r0["bucket_bytes"] == r1["bucket_bytes"] == 2**19, dtype  # comm.bucket_mb = 0.5 reached DDP
        # The gradients were averaged: both replicas hold the same bits after every update. (Under the
        # bf16 cast a reducer built at the first forward would have hooked the cast copies and the
        # replicas would drift apart from step 1.)
        assert r0["bits"] == r1["bits"], dtype
    assert got["bfloat16"][0]["cast"] == "torch.bfloat16" and got["float32"][0]["cast"] == "None"
    one = train("float32", 0, 1)  # the whole batch in one process; the replicas report the mean over both
    for step, (want, have) in enumerate(zip(one["losses"], got["float32"][0]["losses"]), 1):
        assert abs(have - want) <= 1e-5 * abs(want), (step, want, have)


def test_the_bucket_layout_is_kept_where_it_changes_the_sums():
    assert not keeps_bucket_layout(2) and keeps_bucket_layout(3) and keeps_bucket_layout(8)
