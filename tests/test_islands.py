"""The islands' outer optimization as pure functions (parallel/islands.py): schedule, fragments,
quantized payloads with error feedback, the ordered mean and the outer Nesterov step."""

import pytest
import torch

from stalwart.config.core import ConfigError
from stalwart.config.islands import IslandsConfig
from stalwart.parallel.islands import Schedule, average, dequantize, fragments_of, nesterov, quantize
from stalwart.planner.islands import payload_bytes

pytestmark = pytest.mark.unit


def test_schedules_launch_and_apply_where_the_papers_say():
    d = Schedule("diloco", 50, 4, 1)  # diloco: whole model, no fragments, no overlap
    assert [s.launch for s in map(d.launched_at, range(1, 201)) if s] == [50, 100, 150, 200]
    assert d.applied_at(100) == d.launched_at(100)
    s = Schedule("streaming", 100, 4, 2)
    launches = [x for x in map(s.launched_at, range(1, 201)) if x]
    assert [(x.launch, x.fragment, x.apply) for x in launches[:5]] == [
        (25, 0, 27), (50, 1, 52), (75, 2, 77), (100, 3, 102), (125, 0, 127)]
    assert s.applied_at(27).launch == 25 and s.applied_at(26) is None
    assert all(Schedule("sync", 50, 4, 1).launched_at(n) for n in range(1, 10))


def test_fragments_split_the_blocks_in_runs_and_keep_embedding_and_head_at_the_ends():
    names = ["tok_embeddings.weight", *[f"layers.{i}.attention.wq.weight" for i in range(8)], "norm.weight",
             "output.weight"]
    assert fragments_of(names, 8, 4) == [0, 0, 0, 1, 1, 2, 2, 3, 3, 3, 3]
    assert set(fragments_of(names, 8, 1)) == {0}


@pytest.mark.parametrize("how,tol", [("none", 0.0), ("bf16", 2 ** -8), ("int8", 1 / 127), ("int4", 1 / 7)])
def test_payloads_are_as_small_as_claimed_and_round_trip_within_a_step(how, tol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.linspace(0.01, 3, 1000)
    p = quantize(x, how, 64)
    assert p.dtype == torch.uint8 and p.numel() == payload_bytes(1000, how, 64)
    y = dequantize(p, 1000, how, 64)
    # bf16: within its relative rounding; int8/int4: within half a step of the block's scale.
    step = x.abs() if how == "bf16" else x.view(-1, 1).abs().new_tensor(
        [x[i // 64 * 64:(i // 64 + 1) * 64].abs().max() for i in range(1000)])
    assert bool(((y - x).abs() <= tol * step / (2 if how != "bf16" else 1) + 1e-7).all())
    assert payload_bytes(1000, how, 64) <= {"none": 4000, "bf16": 2000, "int8": 1024 + 64, "int4": 512 + 64}[how]  # padded to whole blocks


def test_error_feedback_carries_what_rounding_lost_into_the_next_sync():
    """Summed over many syncs, the error-fed int4 payloads track the true sum; without feedback they drift."""
    g = torch.Generator().manual_seed(1)
    residual, fed, plain, true = torch.zeros(256), torch.zeros(256), torch.zeros(256), torch.zeros(256)
    for _ in range(200):
        delta = torch.randn(256, generator=g) * 0.01 + 0.003
        true += delta
        e = delta + residual
        q = quantize(e, "int4", 256)
        residual = e - dequantize(q, 256, "int4", 256)
        fed += dequantize(q, 256, "int4", 256)
        plain += dequantize(quantize(delta, "int4", 256), 256, "int4", 256)
    assert (fed - true).abs().max() <= residual.abs().max() + 1e-6  # off by at most the carried error
    assert (fed - true).abs().max() < (plain - true).abs().max()


def test_mean_is_summed_in_island_order_and_nesterov_matches_torch_sgd():
    xs = [torch.randn(300, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    ps = [quantize(x, "none", 0) for x in xs]
    assert torch.equal(average(ps, 300, "none", 0), (((xs[0] + xs[1]) + xs[2]) + xs[3]) / 4)
    anchor, momentum = torch.randn(50), torch.zeros(50)
    ref = torch.nn.Parameter(anchor.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for i in range(3):
        grad = torch.randn(50, generator=torch.Generator().manual_seed(10 + i))
        nesterov(anchor, momentum, grad, 0.7, 0.9)
        ref.grad = grad.clone()
        opt.step()
    assert torch.allclose(anchor, ref.detach(), atol=1e-6)


def test_config_refuses_fragments_that_do_not_tile_the_inner_steps():
    with pytest.raises(ConfigError, match="multiple of islands.fragments"):
        IslandsConfig(algorithm="streaming", inner_steps=10, fragments=3).validate(2, 100)
    with pytest.raises(ConfigError, match="overlap_steps"):
        IslandsConfig(algorithm="streaming", inner_steps=8, fragments=4, overlap_steps=2).validate(2, 100)
    IslandsConfig(algorithm="diloco", inner_steps=10, fragments=3).validate(2, 100)  # fragments: streaming's


def test_bench_variants_parse_or_name_the_mistake_and_get_a_planner_prediction():
    from stalwart.bench.islands import IslandsBenchConfig, predicted, variant_args

    assert variant_args("streaming:100:4:int4")[1::2] == ["streaming", "100", "4", "int4", "1"]
    for bad in ("diloco", "diloco:x", "streaming:100:4:int3", "async"):
        with pytest.raises(ConfigError, match="variants"):
            variant_args(bad)
    cfg = IslandsBenchConfig(steps=300)
    figures = {"train_s": 161.6, "utilisation": 0.46, "params": 229952, "fragment_params": [229952]}
    p = predicted("sync", figures, cfg)
    assert 0.3 < p["predicted_step_s"] < 1.0 and p["measured_step_s"] == pytest.approx(161.6 / 300)
