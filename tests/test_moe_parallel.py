"""Expert parallelism trains the same numbers as one process (fp32, gloo, spawned workers).

A tiny mixture of experts (one dense layer, three sparse ones, 8 experts, top-2, auxiliary loss and bias
balancing on) is trained for 5 steps by the training core under each layout. Routing is skewed on
purpose: expert 0 is always chosen and expert 7 never, so under ep=2 rank 0's experts receive about
three times the tokens of rank 1's and one expert receives none. Per-step losses, the auxiliary loss and
the step-1 gradients of a router and an expert weight must match the single process. Layouts: ep=2, ep=2 with
activation checkpointing, pp=2, replicated by DDP (2 ranks); ep=2 x dp_shard_mod_ep=2, ep=2 x tp=2, ep=2 x pp=2 (4 ranks).
"""

from __future__ import annotations

import time

import pytest
import torch

from conftest import spawn_gloo
from stalwart.config.job import CommConfig, OptimizerConfig, ParallelismConfig, SchedulerConfig, TrainingConfig
from stalwart.data.loader import Batch
from stalwart.models.flavors import MoEArgs, TransformerArgs
from stalwart.models.moe import moe_modules
from stalwart.train.core import CoreSpec, TrainCore
from stalwart.runtime.env import DistEnv
from stalwart.train.init import canonical_name

pytestmark = pytest.mark.multiproc

ARGS = TransformerArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64, max_seq_len=16,
                       moe=MoEArgs(n_experts=8, top_k=2, hidden=32, n_dense_layers=1, aux_loss_coef=0.01,
                                   bias_update_rate=1e-3))
GLOBAL_BATCH, SEQ, STEPS = 4, 16, 5
GRADS = ["layers.1.moe.router.gate.weight", "layers.2.moe.experts.w1"]
SKEW = [1.0, 0, 0, 0, 0, 0, 0, -1.0]  # expert 0 always chosen, expert 7 never


def run_layout(layout: dict, rank: int, world: int) -> dict:
    """Train STEPS steps under ``layout`` (parallelism fields) on this rank; per-step records and grads."""
    dims_cfg = ParallelismConfig(**layout)
    pp_or_dp = world // (layout.get("tp", 1) * layout.get("pp", 1))
    per_rank = GLOBAL_BATCH // pp_or_dp
    spec = CoreSpec(ARGS, dims_cfg, CommConfig(), OptimizerConfig(lr=1e-2), SchedulerConfig(warmup_steps=1),
                    TrainingConfig(steps=STEPS, global_batch=GLOBAL_BATCH, micro_batch=1), seq_len=SEQ,
                    accum_steps=per_rank)
    core = TrainCore.build(spec, DistEnv(rank, world, rank, world, torch.device("cpu")))
    for stage in core.pm.stages:
        for moe in moe_modules(stage).values():
            moe.router.expert_bias.copy_(torch.tensor(SKEW))
    grads: dict[str, list] = {}

    def capture(step: int, loss):
        if step == 1:
            params = {canonical_name(n): p for n, p in core.model.named_parameters()}
            for name in GRADS:
                if name in params:
                    g = params[name].grad
                    grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).tolist()
        return loss

    core.backward_hooks.append(capture)
    dp_rank = core.dims.dp_rank(rank)
    records, t0 = [], time.perf_counter()
    for step in range(STEPS):
        x = torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        mine = x[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        micro = [Batch(mine[i:i + 1, :-1], mine[i:i + 1, 1:]) for i in range(per_rank)]
        rec = core.train_step(micro)
        records.append({k: rec[k] for k in ("loss", "moe_aux_loss", "moe_tokens_per_expert", "moe_expert_bias")})
    return {"records": records, "grads": grads, "seconds": time.perf_counter() - t0}


def spawn(tmp_path, world: int, layouts: list[dict]) -> list[list[dict]]:
    return spawn_gloo(tmp_path, world, run_layout, layouts)


def merged_grads(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Each parameter's full gradient from whichever rank holds it (pipeline stages hold some)."""
    out = {}
    for r in ranks:
        out.update({k: torch.tensor(v) for k, v in r["grads"].items()})
    return out


@pytest.fixture(scope="module")
def reference():
    return run_layout({}, 0, 1)


def assert_matches(reference: dict, ranks: list[dict], label: str) -> None:
    got = ranks[0]["records"]
    for step, (want, have) in enumerate(zip(reference["records"], got), 1):
        assert abs(have["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (label, step, want["loss"], have["loss"])
        assert abs(have["moe_aux_loss"] - want["moe_aux_loss"]) <= 1e-6 * want["moe_aux_loss"], (label, step)
        assert have["moe_tokens_per_expert"] == want["moe_tokens_per_expert"], (label, step)
        assert have["moe_expert_bias"] == want["moe_expert_bias"], (label, step)
    grads = merged_grads(ranks)
    for name in GRADS:
        torch.testing.assert_close(grads[name], torch.tensor(reference["grads"][name]), rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{label} {name}: {m}")


def test_skewed_routing_reaches_the_cases_that_matter(reference):
    """Step 1 really has an expert without tokens and ep ranks with very different loads."""
    counts = reference["records"][0]["moe_tokens_per_expert"]
    for layer in counts.values():
        assert layer[7] == 0 and layer[0] == GLOBAL_BATCH * SEQ
        rank0, rank1 = sum(layer[:4]), sum(layer[4:])
        assert rank0 >= 2.5 * rank1 > 0, layer


def test_expert_parallel_on_two_ranks_and_pipeline_match_one_process(reference, tmp_path):
    ep2, ep2_ac, pp2, ddp2 = spawn(tmp_path, 2, [{"ep": 2}, {"ep": 2, "activation_checkpoint": "full"},
                                                 {"pp": 2, "dp_shard": 1}, {"data_parallel": "replicate"}])
    assert_matches(reference, ep2, "ep2")
    assert_matches(reference, ddp2, "replicated (DDP), an expert without tokens")
    assert_matches(reference, ep2_ac, "ep2 with activation checkpointing (all-to-alls recomputed)")
    assert_matches(reference, pp2, "pp2")


def test_expert_parallel_with_fsdp_tensor_and_pipeline_parallel_match_one_process(reference, tmp_path):
    ep2_dp2, ep2_tp2, ep2_pp2 = spawn(tmp_path, 4, [{"ep": 2}, {"ep": 2, "tp": 2, "dp_shard": 2}, {"ep": 2, "pp": 2}])
    assert_matches(reference, ep2_dp2, "ep2 x dp_shard_mod_ep2")
    assert_matches(reference, ep2_tp2, "ep2 x tp2")
    assert_matches(reference, ep2_pp2, "ep2 x pp2")
