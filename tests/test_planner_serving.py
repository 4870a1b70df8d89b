"""The serving placement planner: what it offers, what it picks for each target, why, and its CLI."""

import dataclasses
import json

import pytest

from stalwart.config import ConfigError
from stalwart.models.flavors import FLAVORS as MODEL_FLAVORS
from stalwart.planner.serving import (ServingRequest, evaluate, host_presets, host_s, plan, ring_all_reduce_s,
                                      shape_from_args, stage_boundaries, tp_invalid_reason)
from stalwart.cli.serve_plan import main
from stalwart.planner.shapes import FLAVORS

PRESETS = host_presets()
REQ = ServingRequest(context_tokens=4096, prompt_tokens=512, output_tokens=256)


def chosen(p):
    return p.ranked[0].tp, p.ranked[0].pp, p.ranked[0].replicas


@pytest.mark.unit
def test_model_too_big_for_one_device_is_split_and_the_why_says_so():
    shape = FLAVORS["llama3-70B"]
    result = plan(shape, PRESETS["h100"], REQ)
    best = result.ranked[0]
    assert best.tp * best.pp > 1 and best.tp * best.pp * best.replicas == 8
    assert all((p.tp, p.pp) != (1, 1) for p in result.ranked)
    assert result.why[0].startswith("tp*pp>=2 needed: at tp=1 pp=1 weights")
    assert f"{shape.params * 2 / 1e9:.2f} GB do not fit in one 80.0 GB device" in result.why[0]


@pytest.mark.unit
def test_pp_across_hosts_when_one_host_cannot_hold_the_model():
    hosts = dataclasses.replace(PRESETS["h100"], hosts=2)
    result = plan(FLAVORS["llama3-405B"], hosts, dataclasses.replace(REQ, context_tokens=8192))
    assert chosen(result) == (8, 2, 1)
    assert any(line.startswith("pp=2 needed: the model and one context exceed one host") for line in result.why)
    assert stage_boundaries(hosts, 8, 2, 1) == (0, 1)          # the one boundary crosses the hosts
    assert result.ranked[0].pp_comm_s > 0


@pytest.mark.unit
def test_latency_prefers_tp_over_replicas_on_nvlink():
    result = plan(FLAVORS["llama3-8B"], PRESETS["h100"], dataclasses.replace(REQ, target="latency"))
    best = result.ranked[0]
    single = next(p for p in result.ranked if (p.tp, p.pp) == (1, 1))
    assert best.tp > 1 and best.pp == 1 and best.replicas < single.replicas
    assert best.tpot_batch1_s < single.tpot_batch1_s
    assert best.tpot_batch1_s == min(p.tpot_batch1_s for p in result.ranked)


@pytest.mark.unit
def test_latency_keeps_tp1_on_a_slow_loopback_link_and_blames_the_all_reduce():
    shape = shape_from_args(MODEL_FLAVORS["tiny"])
    result = plan(shape, PRESETS["cpu"], dataclasses.replace(REQ, target="latency"))
    assert chosen(result) == (1, 1, 2)
    cpu = PRESETS["cpu"]
    one = ring_all_reduce_s(shape.dim * 2, 2, cpu.intra_host_gb_per_s, cpu.intra_host_latency_us)
    line = next(line for line in result.why if "beat tp=2" in line)
    assert f"TP all-reduce adds {2 * shape.n_layers * one * 1e3:.3f} ms per token at tp=2" in line


@pytest.mark.unit
def test_throughput_prefers_replicas_when_the_model_fits_one_device():
    result = plan(FLAVORS["llama3-8B"], PRESETS["h100"], REQ)
    assert chosen(result) == (1, 1, 8)
    assert result.ranked[0].tokens_per_s == max(p.tokens_per_s for p in result.ranked)
    assert any(line.startswith("replicas=8 beat tp=2") for line in result.why)


@pytest.mark.unit
@pytest.mark.parametrize("flavor,preset", [("llama3-8B", "h100"), ("llama3-70B", "h100"), ("llama3-1B", "a100")])
def test_pp_is_never_chosen_for_latency_when_tp_fits(flavor, preset):
    result = plan(FLAVORS[flavor], PRESETS[preset], dataclasses.replace(REQ, target="latency"))
    assert result.ranked[0].pp == 1
    by_layout = {(p.tp, p.pp): p for p in result.ranked}
    for (tp, pp), p in by_layout.items():
        if pp > 1 and (tp, 1) in by_layout:
            assert p.tpot_batch1_s > by_layout[(tp, 1)].tpot_batch1_s


@pytest.mark.unit
def test_tp_degrees_that_do_not_split_the_kv_heads_are_not_offered():
    shape = shape_from_args(MODEL_FLAVORS["debug"])         # 4 heads, 2 kv heads
    result = plan(shape, PRESETS["h100"], REQ, tp_options=(1, 2, 4, 8))
    assert {p.tp for p in result.ranked + result.rejected} == {1, 2}
    assert tp_invalid_reason(shape, PRESETS["h100"], 4) == "tp=4 does not divide 4 heads / 2 kv heads"
    assert tp_invalid_reason(FLAVORS["llama3-8B"], PRESETS["cpu"], 4).endswith("the 2 processes of a host")


@pytest.mark.unit
def test_nothing_fits_names_the_fields_to_change():
    with pytest.raises(ConfigError, match=r"weights .* do not fit .*raise hosts\.hosts or hosts\.memory_gb"):
        plan(FLAVORS["llama3-70B"], PRESETS["cpu"], REQ)
    with pytest.raises(ConfigError, match=r"target\.max_tpot_ms 0\.1: the fastest placement needs"):
        plan(FLAVORS["llama3-8B"], PRESETS["h100"], dataclasses.replace(REQ, target="latency", max_tpot_ms=0.1))


@pytest.mark.unit
def test_kv_cache_too_small_for_one_context_rejects_the_placement():
    hosts = dataclasses.replace(PRESETS["h100"], memory_gb=20.5)       # 16 GB of weights + 4 GB headroom
    result = plan(FLAVORS["llama3-8B"], hosts, REQ, tp_options=(1,), pp_options=(1, 2))
    single = next(p for p in result.rejected if (p.tp, p.pp) == (1, 1))
    assert "less than one 4,096-token context" in single.reason
    assert chosen(result) == (1, 2, 4)


@pytest.mark.unit
def test_a_tpot_bound_shrinks_the_throughput_batch():
    free = plan(FLAVORS["llama3-8B"], PRESETS["h100"], REQ).ranked[0]
    bound_ms = free.tpot_s * 1e3 * 0.8
    bounded = plan(FLAVORS["llama3-8B"], PRESETS["h100"], dataclasses.replace(REQ, max_tpot_ms=bound_ms))
    for p in bounded.ranked:
        assert p.tpot_s * 1e3 <= bound_ms
    same = next(p for p in bounded.ranked if (p.tp, p.pp) == (free.tp, free.pp))
    assert same.batch_limit == "max_tpot" and same.batch < free.batch


@pytest.mark.unit
def test_host_work_adds_on_a_cpu_and_overlaps_on_an_accelerator():
    """A small model's step is its host's work: on the cpu preset it adds to the roofline (the time per
    token of the debug model is milliseconds, as measured, not the roofline's microseconds); on a GPU
    preset given host terms the step is the longer of the two, so a model whose device time is below the
    host's gains nothing from tensor parallelism."""
    shape = shape_from_args(MODEL_FLAVORS["tiny"])
    req = dataclasses.replace(REQ, prompt_tokens=3, output_tokens=64, context_tokens=160)
    cpu = PRESETS["cpu"]
    bare = dataclasses.replace(cpu, host_layer_us=0.0, host_seq_layer_us=0.0, host_step_us=0.0, host_token_us=0.0)
    with_host, without = evaluate(shape, cpu, req, 1, 1), evaluate(shape, bare, req, 1, 1)
    host1 = host_s(shape, cpu, 1)
    assert host1 == pytest.approx(1e-6 * (shape.n_layers * (480 + 9) + 520 + 390))
    assert with_host.tpot_batch1_s == pytest.approx(without.tpot_batch1_s + host1)
    assert with_host.tpot_s == pytest.approx(without.tpot_s + host_s(shape, cpu, with_host.batch))
    gpu = dataclasses.replace(PRESETS["h100"], host_layer_us=450.0)
    for tp in (1, 2):
        p, device_only = evaluate(shape, gpu, req, tp, 1), evaluate(shape, PRESETS["h100"], req, tp, 1)
        compute = device_only.tpot_batch1_s - device_only.tp_comm_batch1_s
        assert compute < host_s(shape, gpu, 1)
        assert p.tpot_batch1_s == pytest.approx(host_s(shape, gpu, 1) + p.tp_comm_batch1_s)
    assert plan(shape, gpu, dataclasses.replace(req, target="latency")).ranked[0].tp == 1


@pytest.mark.unit
def test_model_flavors_convert_to_the_planner_shape():
    assert shape_from_args(MODEL_FLAVORS["llama3-8B"]) == FLAVORS["llama3-8B"]
    assert ring_all_reduce_s(1e9, 4, 1.0, 0.0) == pytest.approx(1.5)


@pytest.mark.unit
def test_cli_prints_a_table_and_the_choice(capsys):
    assert main(["--model.flavor", "llama3-70B", "--hosts.preset", "h100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stalwart serve --plan: llama3-70B (70.6B params, bf16), 1 host(s) x 8")
    assert "tokens/s" in out and "TPOT ms" in out
    assert "\nchosen: tp=4 pp=1 replicas=2\n" in out
    assert "tp*pp>=2 needed" in out


@pytest.mark.unit
def test_cli_default_is_a_small_model_on_the_cpu_preset(capsys):
    assert main(["--target.kind=latency"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "2-core CPU VM" in out and "chosen: tp=1 pp=1 replicas=2" in out


@pytest.mark.unit
def test_cli_json_and_help(tmp_path, capsys):
    path = tmp_path / "plan" / "serve.json"
    assert main(["--model.flavor", "llama3-8B", "--hosts.preset", "h100", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert (doc["chosen"]["tp"], doc["chosen"]["pp"], doc["chosen"]["replicas"]) == (1, 1, 8)
    assert doc["config"]["hosts"]["preset"] == "h100" and doc["why"]
    assert main(["--help"]) == 0
    assert "usage: stalwart serve --plan" in capsys.readouterr().out


@pytest.mark.unit
def test_cli_rejects_bad_input_with_one_line():
    with pytest.raises(ConfigError, match="hosts.memory_gb"):
        main(["--model.flavor", "llama3-70B"])
    with pytest.raises(ConfigError, match="model.flavor"):
        main(["--model.flavor", "llama9"])
    with pytest.raises(ConfigError, match="target.context"):
        main(["--target.context", "100"])


@pytest.mark.unit
def test_prefill_decode_splits_and_the_choice(capsys):
    """planner/disagg.py: colocated and every P:D; a split's p99 time per token is free of the prompt chunks
    colocated's carries; the least p99 within 10 % of the most throughput is chosen; the CLI prints it."""
    from stalwart.planner.disagg import choose, splits

    shape, cpu = shape_from_args(MODEL_FLAVORS["tiny"]), PRESETS["cpu"]
    req = dataclasses.replace(REQ, context_tokens=2048, prompt_tokens=200, output_tokens=80, param_bytes=4, kv_bytes=4)
    cands = splits(shape, cpu, req, 4, 4, 512, cpu.devices)
    assert sorted(c.name for c in cands) == ["1:3", "2:2", "3:1", "colocated x4"]
    colocated = next(c for c in cands if not c.prefill)
    assert all(c.tpot_p99_s < colocated.tpot_p99_s for c in cands if c.prefill)
    assert choose(cands).name == "1:3" and choose(cands, within=0.99) is colocated
    assert choose(cands, max_tpot_s=0.009).name == "2:2"  # the bound rules 1:3 out
    few = splits(shape, cpu, dataclasses.replace(req, prompt_tokens=1500, output_tokens=40), 4, 4, 512, cpu.devices)
    assert choose(few).prefill == 0  # prompt-heavy: every split loses more than 10 % of the throughput
    assert main(["--model.flavor", "tiny", "--model.params_dtype", "fp32", "--target.context", "2048",
                 "--target.prompt_tokens", "200", "--target.output_tokens", "80", "--target.replicas", "4"]) == 0
    out = capsys.readouterr().out
    assert "prefill:decode over 4 one-process replicas" in out and "\nchosen: " in out.split("prefill:decode")[1]
