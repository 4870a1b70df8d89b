"""The planner on mixture-of-experts shapes: active vs total parameters, expert memory under expert
parallelism, the all-to-all on the right network tier, and EP layouts in the ranking (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from stalwart.planner.cost import Network, all_to_all_s, step_time
from stalwart.planner.hardware import GPUS
from stalwart.planner.layout import Layout, Workload, invalid_reason
from stalwart.planner.memory import memory_per_rank
from stalwart.planner.search import Space, rank_layouts
from stalwart.planner.shapes import FLAVORS

pytestmark = pytest.mark.unit

MIXTRAL = Workload(FLAVORS["mixtral-8x7B"], 4096, 256)
H100 = GPUS["H100"]


def test_total_and_active_parameters_of_published_shapes():
    mixtral = FLAVORS["mixtral-8x7B"]
    assert mixtral.params == pytest.approx(46.7e9, rel=0.01)       # Mixtral 8x7B: 46.7B total
    assert mixtral.active_params == pytest.approx(12.9e9, rel=0.01)  # 12.9B active
    deepseek = FLAVORS["deepseek-v3-like"]
    assert deepseek.params == pytest.approx(671e9, rel=0.02) and deepseek.active_params == pytest.approx(37e9, rel=0.06)
    dense = dataclasses.replace(mixtral, n_experts=0)
    assert mixtral.flops_per_token(4096) < 0.3 * dataclasses.replace(
        dense, ffn_hidden=mixtral.expert_hidden * mixtral.n_experts).flops_per_token(4096)


def test_expert_parallel_divides_expert_state_and_is_validated():
    one = memory_per_rank(MIXTRAL, Layout(dp=8, fsdp=False))
    eight = memory_per_rank(MIXTRAL, Layout(dp=8, fsdp=False, ep=8))
    experts = FLAVORS["mixtral-8x7B"].expert_params
    # Unsharded (ZeRO-1) bf16 params: ep8 keeps 1/8 of the experts.
    assert one.params - eight.params == pytest.approx(experts * 2 * (1 - 1 / 8), rel=0.01)
    assert invalid_reason(MIXTRAL, Layout(dp=8, ep=3), 8) is not None       # 8 experts
    assert invalid_reason(MIXTRAL, Layout(dp=4, ep=8), 8) is not None       # ep must divide dp
    assert invalid_reason(Workload(FLAVORS["llama3-8B"], 4096, 16), Layout(dp=8, ep=2), 8) is not None


def test_all_to_all_runs_on_the_tier_its_group_spans():
    net = Network(gpus_per_host=8)
    inside, across = all_to_all_s(1e9, 8, 1, H100, net), all_to_all_s(1e9, 8, 8, H100, net)
    assert 0 < inside < across  # NVLink inside a host, the NIC across hosts
    a = step_time(MIXTRAL, Layout(dp=64, ep=8), H100, net)
    b = step_time(MIXTRAL, Layout(dp=64, tp=2, ep=8), H100, net)
    assert a.tiers["ep"] == "nvlink" and b.tiers["ep"] == "network" and b.ep_s > a.ep_s > 0
    assert step_time(MIXTRAL, Layout(dp=64), H100, net).ep_s == 0


def test_plan_ranks_expert_parallel_layouts():
    space = Space(tp=(1, 2), pp=(1,), cp=(1,), micro_batch=(1,), ac=("full",), fsdp=(True,), ep=(1, 2, 4, 8))
    ranked = rank_layouts(MIXTRAL, 64, H100, space=space)
    eps = {c.layout.ep for c in ranked}
    assert eps == {1, 2, 4, 8} and ranked[0].fits
    by_ep = {c.layout.ep: c for c in ranked if c.layout.tp == 1}
    assert by_ep[8].memory.total < by_ep[1].memory.total  # experts split 8 ways
