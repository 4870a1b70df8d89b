"""Precision is what it says: the configured dtype runs at every layout, MFU is against its peak."""

import json

import pytest
import torch

from conftest import TINY_RUN, run_cli, step_losses
from stalwart.metrics.mfu import PeakCache, choose_auto_dtype, matmul_peak, peak_tflops
from stalwart.models.flavors import FLAVORS
from stalwart.models.llama import Transformer
from stalwart.parallel.activation_checkpoint import apply_activation_checkpointing
from stalwart.parallel.precision import apply_cast


@pytest.mark.unit
def test_auto_picks_bfloat16_only_where_it_is_clearly_faster():
    assert choose_auto_dtype(0.16, 0.08)[0] == torch.float32  # AVX-512 without AMX: bf16 at half rate
    dtype, why = choose_auto_dtype(0.08, 0.19)  # Zen 4 with avx512_bf16: 2.4x
    assert dtype == torch.bfloat16 and "2.38x" in why
    assert choose_auto_dtype(0.1, 0.12)[0] == torch.float32  # faster, but not enough to pay for the casts


@pytest.mark.unit
def test_peak_is_measured_once_then_cached_and_an_override_wins(tmp_path, monkeypatch):
    from stalwart.metrics import mfu

    torch.set_num_threads(1)
    monkeypatch.setattr(mfu, "load_average", lambda: 3.0)  # a steady load (a real one may fall between the calls)
    cache = PeakCache(tmp_path / "peaks.json")
    cpu = torch.device("cpu")
    first = matmul_peak(cpu, torch.float32, cache)
    assert first.source == "measured now" and first.tflops > 0
    again = matmul_peak(cpu, torch.float32, cache)
    assert again.source == "cached" and again.tflops == first.tflops
    assert list(json.loads(cache.path.read_text())) == [k for k in cache.load()]
    assert peak_tflops(cpu, torch.float32, 0.5, cache).source == "configured"


@pytest.mark.unit
def test_a_peak_cached_under_load_is_measured_again_on_a_quieter_machine(tmp_path, monkeypatch):
    """The 1-minute load average is the one thing faked: the matmuls are measured for real."""
    from stalwart.metrics import mfu

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    key = mfu.cache_key(cpu, torch.float32)
    cache = PeakCache(tmp_path / "peaks.json")
    cache.store(key, 1e-6, {f"{key}|load": 9.0})  # 1 MFLOP/s, as if measured with the cores shared
    monkeypatch.setattr(mfu, "load_average", lambda: 8.5)  # not quieter enough: the cached figure stands
    assert matmul_peak(cpu, torch.float32, cache).tflops == 1e-6
    monkeypatch.setattr(mfu, "load_average", lambda: 0.5)
    again = matmul_peak(cpu, torch.float32, cache)
    assert again.source == "measured now" and again.tflops > 1e-3
    assert cache.load()[f"{key}|load"] == 0.5 and matmul_peak(cpu, torch.float32, cache).source == "cached"
    cache.store(key, 1e3, {f"{key}|load": 9.0})  # higher than this CPU can do: measuring again keeps it
    kept = matmul_peak(cpu, torch.float32, cache)
    assert kept.tflops == 1e3 and "measured again" in kept.detail
    assert matmul_peak(cpu, torch.float32, cache).source == "cached"  # the quieter load recorded: not again
    legacy = PeakCache(tmp_path / "legacy.json")
    legacy.store(key, 1e-6)  # cached before loads were recorded: measured again once
    assert matmul_peak(cpu, torch.float32, legacy).source == "measured now"


@pytest.mark.unit
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_cast_computes_in_bf16_and_keeps_fp32_master_gradients(checkpointing):
    torch.manual_seed(0)
    ref_model = Transformer(FLAVORS["debug"])
    model = Transformer(FLAVORS["debug"])
    model.load_state_dict(ref_model.state_dict())
    # Blocks recomputed in backward cast again (before the cast moved into the blocks' hooks, a checkpointed
    # block recomputed on the fp32 parameters: a dtype error under "full", a metadata error under "selective").
    apply_activation_checkpointing(model, checkpointing)
    apply_cast(model, torch.bfloat16)
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    out = model(tokens, None)
    assert out.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # restored after the call
    out.float().square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and g.dtype == torch.float32 for g in grads.values())
    ref = ref_model(tokens, None)
    assert ref.dtype == torch.float32 and not torch.equal(ref, out.float())
    assert (ref - out.float()).abs().max() <= 0.05 * ref.abs().max()
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(IndexError):  # raised inside the embedding, while its parameter is swapped out
        model(tokens + model.args.vocab_size, None)
    assert [n for n, _ in model.named_parameters()] == names
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.e2e
def test_one_process_runs_bfloat16_and_mfu_stays_below_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # measure the peaks afresh
    runs = {}
    for dtype in ("float32", "bfloat16"):
        run_dir = tmp_path / dtype
        proc = run_cli("train", "--run.dir", str(run_dir), *TINY_RUN, "--training.steps", "4",
                       "--training.dtype", dtype, "--metrics.peak_tflops", "0", "--checkpoint.at_end", "false",
                       "--sample.max_new_tokens", "0")
        assert f"{dtype} (configured)" in proc.stdout
        summary = json.loads((run_dir / "summary.json").read_text())
        assert 0 < summary["mfu"] <= 1, summary
        assert summary["peak_source"].startswith("measured now: " + {"float32": "fp32", "bfloat16": "bf16"}[dtype])
        runs[dtype] = step_losses(run_dir)
    fp32, bf16 = runs["float32"], runs["bfloat16"]
    assert fp32 != bf16  # the bf16 policy really ran
    assert all(abs(fp32[s] - bf16[s]) <= 0.02 * fp32[s] for s in fp32)
    assert (tmp_path / "cache" / "stalwart" / "matmul_peaks.json").is_file()
