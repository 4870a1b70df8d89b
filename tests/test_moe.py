"""Mixture of experts on one device: routing, grouped computation, balancing, shapes and layout checks."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from stalwart.models.flavors import FLAVORS, MoEArgs, TransformerArgs, resolve_args
from stalwart.models.llama import Transformer, count_params, flops_per_token
from stalwart.models.moe import MoE, TopKRouter
from stalwart.parallel.dims import LayoutError, ParallelDims
from stalwart.parallel.expert import block_permutation
from stalwart.train.experts import ExpertBalancer, imbalance, update_bias
from stalwart.train.init import materialize_and_init

pytestmark = pytest.mark.unit

MOE = MoEArgs(n_experts=8, top_k=2, hidden=24, n_shared=1, aux_loss_coef=0.01)


def build_moe(moe: MoEArgs = MOE, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    m = MoE(16, moe, None)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    m.reset_buffers()
    return m


def test_grouped_matmul_and_expert_loop_agree_even_with_an_idle_expert():
    x = torch.randn(3, 10, 16)
    results = []
    for grouped in (True, False):
        m = build_moe(dataclasses.replace(MOE, grouped_mm=grouped))
        m.router.expert_bias[5] = -10.0  # expert 5 receives no tokens
        y = m(x)
        (y * torch.linspace(-1, 1, 16)).sum().backward()
        assert m.stat_tokens[5] == 0 and m.stat_tokens.sum() == 3 * 10 * 2
        results.append((y.detach(), m.experts.w1.grad.clone(), m.router.gate.weight.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert results[0][1][5].abs().sum() == 0  # the idle expert gets a zero gradient, not a missing one


def test_output_is_the_weighted_sum_of_the_chosen_experts():
    m = build_moe(dataclasses.replace(MOE, n_shared=0, aux_loss_coef=0.0))
    x = torch.randn(1, 5, 16)
    _, selected, weights = m.router(x.view(-1, 16))
    want = torch.zeros(5, 16)
    for t in range(5):
        for j in range(2):
            e = int(selected[t, j])
            h = torch.nn.functional.silu(x[0, t] @ m.experts.w1[e]) * (x[0, t] @ m.experts.w3[e])
            want[t] += weights[t, j] * (h @ m.experts.w2[e])
    torch.testing.assert_close(m(x)[0], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))  # renormalised top-k weights


def test_aux_loss_is_per_sequence_so_splitting_the_batch_does_not_change_it():
    m = build_moe()
    x = torch.randn(4, 12, 16)
    m(x)
    whole = float(m.stat_misc[0])
    m.reset_stats()
    m(x[:2]), m(x[2:])
    halves = float(m.stat_misc[0]) / 2  # the mean of the two micro-batches' values
    assert whole > 0 and abs(whole - halves) < 1e-6 * whole


def test_aux_loss_gradient_reaches_the_router_without_changing_the_output():
    x = torch.randn(2, 8, 16)
    with_aux, without = build_moe(), build_moe(dataclasses.replace(MOE, aux_loss_coef=0.0))
    torch.testing.assert_close(with_aux(x), without(x))
    with_aux(x).sum().backward()
    without(x).sum().backward()
    assert not torch.allclose(with_aux.router.gate.weight.grad, without.router.gate.weight.grad)


def test_bias_balancing_lowers_the_load_imbalance_of_skewed_routing():
    torch.manual_seed(0)
    router = TopKRouter(16, MoEArgs(n_experts=8, top_k=2, hidden=8))
    torch.nn.init.normal_(router.gate.weight, std=0.5)
    router.expert_bias.zero_()
    x = torch.randn(512, 16) + 2.0 * router.gate.weight[0] / router.gate.weight[0].norm()  # favours expert 0

    def load() -> torch.Tensor:
        return torch.bincount(router(x)[1].flatten(), minlength=8)

    before = imbalance(load())
    for _ in range(200):
        update_bias(router.expert_bias, load(), rate=0.01)
    after = imbalance(load())
    assert before > 3.0 and after < 1.5 and after < before / 2, (before, after)


def test_block_permutation_groups_rows_by_expert():
    sizes = torch.tensor([[2, 0, 1], [1, 3, 0]])  # (source rank, local expert)
    # Rows as they arrive: rank 0's (e0, e0, e2), then rank 1's (e0, e1, e1, e1).
    labels = torch.tensor([(0, 0), (0, 0), (0, 2), (1, 0), (1, 1), (1, 1), (1, 1)])
    grouped = labels[block_permutation(sizes)]
    assert grouped.tolist() == [[0, 0], [0, 0], [1, 0], [1, 1], [1, 1], [1, 1], [0, 2]]


def test_dense_and_sparse_layers_mix_and_parameters_count_as_active_or_total():
    args = FLAVORS["debug-moe"]
    with torch.device("meta"):
        model = Transformer(args)
    assert model.layers["0"].feed_forward is not None and model.layers["0"].moe is None
    assert all(model.layers[str(i)].moe is not None for i in range(1, 4))
    assert count_params(args) == sum(p.numel() for p in model.parameters())  # tied: counted once
    dense = dataclasses.replace(FLAVORS["debug"], n_layers=4)
    routers = 3 * args.dim * args.moe.n_experts
    # The debug MoE computes as much per token as the dense debug model (plus its routers).
    assert count_params(args, active=True) == count_params(dense) + routers
    assert flops_per_token(args, 32) == pytest.approx(flops_per_token(dense, 32) + 6 * routers)
    m = args.moe  # the idle experts of the three sparse layers
    assert count_params(args) - count_params(args, active=True) == 3 * 3 * args.dim * m.hidden * (m.n_experts - m.top_k)


def test_experts_initialise_from_their_names():
    args = dataclasses.replace(FLAVORS["debug-moe"], max_seq_len=16)
    values = []
    for _ in range(2):
        with torch.device("meta"):
            model = Transformer(args)
        materialize_and_init(model, torch.device("cpu"), seed=3)
        values.append(model.layers["2"].moe.experts.w2.detach().clone())
        assert torch.equal(model.layers["2"].moe.router.expert_bias, torch.zeros(8))
    assert torch.equal(values[0], values[1]) and values[0].std() > 0


def _model_cfg(**kw) -> SimpleNamespace:
    base = dict(flavor="debug", dim=0, n_layers=0, n_heads=0, n_kv_heads=0, ffn_hidden=0, rope_theta=0.0,
                tie_embeddings="auto", vocab_size=0, max_seq_len=0, parallel_block=False, sliding_window=0,
                init_std=0.02, moe_experts=0, moe_top_k=0, moe_hidden=0, moe_shared=-1, moe_dense_layers=-1,
                moe_score="auto", moe_aux_loss=-1.0, moe_bias_rate=-1.0, moe_compute="grouped", embed_dim=0)
    return SimpleNamespace(**{**base, **kw})


def test_config_turns_a_flavor_sparse_and_overrides_the_moe_shape():
    assert resolve_args(_model_cfg(), 300, 32).moe is None
    a = resolve_args(_model_cfg(moe_experts=4, moe_dense_layers=0), 300, 32)
    assert (a.moe.n_experts, a.moe.top_k, a.moe.n_dense_layers) == (4, 2, 0)
    b = resolve_args(_model_cfg(flavor="debug-moe", moe_top_k=1, moe_score="sigmoid", moe_bias_rate=0.0,
                                moe_compute="loop"), 300, 32)
    assert (b.moe.top_k, b.moe.score_func, b.moe.bias_update_rate, b.moe.grouped_mm, b.moe.n_dense_layers) == \
        (1, "sigmoid", 0.0, False, 1)
    with pytest.raises(ValueError, match="model.moe_top_k"):
        resolve_args(_model_cfg(flavor="debug-moe", moe_top_k=9), 300, 32)


def _par(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{**dict(dp_replicate=1, dp_shard=-1, tp=1, pp=1, cp=1, ep=1), **kw})


def test_expert_parallel_degree_is_validated():
    dims = ParallelDims.resolve(_par(ep=2), 4)
    assert (dims.dp_shard, dims.ep, dims.describe()) == (4, 2, "dp_shard=4 x ep=2")
    with pytest.raises(LayoutError, match="parallelism.ep = 4 must divide parallelism.dp_shard = 2"):
        ParallelDims.resolve(_par(ep=4, tp=2), 4)
    with pytest.raises(LayoutError, match="parallelism.ep.*dp_replicate"):
        ParallelDims.resolve(_par(ep=2, dp_replicate=2), 4)
    with pytest.raises(LayoutError, match="dense"):
        dims.check_model(4, 2, 4, 32, n_experts=0)
    with pytest.raises(LayoutError, match="divide the 6 experts"):
        ParallelDims.resolve(_par(ep=4), 4).check_model(4, 2, 4, 32, n_experts=6)


def test_balancer_reports_load_and_moves_bias_towards_balance():
    args = TransformerArgs(dim=16, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=64, ffn_hidden=32, max_seq_len=8,
                           moe=MoEArgs(n_experts=4, top_k=1, hidden=8, n_dense_layers=1, bias_update_rate=0.1))
    with torch.device("meta"):
        model = Transformer(args)
    materialize_and_init(model, torch.device("cpu"), 0)
    moe = model.layers["1"].moe
    moe.router.expert_bias.copy_(torch.tensor([5.0, 0, 0, 0]))  # everything to expert 0
    balancer = ExpertBalancer([model], args, ParallelDims.resolve(_par(), 1), torch.device("cpu"), False)
    model(torch.randint(0, 64, (2, 8)))
    rec = balancer.after_step(committed=True)
    assert rec["moe_tokens_per_expert"] == {"1": [16, 0, 0, 0]} and rec["moe_load_imbalance"] == 4.0
    assert rec["moe_expert_bias"] == {"1": [5.0, 0.0, 0.0, 0.0]}  # the bias this step routed with
    assert moe.router.expert_bias.tolist() == pytest.approx([4.9, 0.1, 0.1, 0.1])
    assert moe.stat_tokens.sum() == 0  # statistics restart every step
    balancer.after_step(committed=False)  # a skipped step does not move the bias
    assert moe.router.expert_bias.tolist() == pytest.approx([4.9, 0.1, 0.1, 0.1])
