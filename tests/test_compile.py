"""Compiled blocks: `parallelism.compile = auto` decides from measured figures, and a compiled run
recovered from a checkpoint (a crash, a restart, a resume) ends bit for bit like an uninterrupted
compiled one."""

import json

import pytest
import torch

from conftest import TINY_RUN, assert_same_states, run_cli
from stalwart.checkpoint.inspect import digest
from stalwart.metrics.mfu import PeakCache
from stalwart.models.flavors import FLAVORS
from stalwart.train.compile_choice import BlockTimes, block_times, choose_compile


@pytest.mark.unit
def test_auto_compiles_only_where_it_is_faster_and_repays_its_start_up():
    fast = BlockTimes(eager_s=0.030, compiled_s=0.024, first_s=60.0, warm_s=4.0)  # 1.25x
    on, why = choose_compile(fast, blocks_per_step=4, steps=1000)  # 24 s saved > 4 s start-up
    assert on and "1.25x" in why and "start-up 4.0 s cached, 60.0 s first" in why
    assert not choose_compile(fast, 4, 100)[0]  # 2.4 s saved: the start-up is not repaid
    assert not choose_compile(BlockTimes(0.030, 0.029, 60.0, 4.0), 4, 10**6)[0]  # 1.03x: not worth it
    on, why = choose_compile(BlockTimes(0.001), 4, 10)
    assert not on and "under the 60 s it takes" in why


@pytest.mark.unit
def test_a_run_too_short_to_repay_a_compile_is_decided_without_compiling(tmp_path):
    torch.set_num_threads(1)
    cache = PeakCache(tmp_path / "peaks.json")
    cpu = torch.device("cpu")
    t = block_times(FLAVORS["debug"], 2, 32, torch.float32, "none", cpu, blocks_per_step=4, steps=10, cache=cache)
    assert t.eager_s > 0 and t.compiled_s == 0  # nothing compiled
    assert not choose_compile(t, 4, 10)[0]
    (key,) = cache.load()
    assert key.endswith("|compile block dim 64 heads 4/2 ffn 192|2x32|ac none|eager_s")
    again = block_times(FLAVORS["debug"], 2, 32, torch.float32, "none", cpu, 4, 10, cache)
    assert again.eager_s == t.eager_s  # cached: not measured again


@pytest.mark.e2e
def test_compiled_run_recovered_from_a_checkpoint_is_bit_identical(tmp_path):
    """One process, compiled: a run that crashes at step 4 and restarts from its step-2 checkpoint (a
    new process that loads the compiled code from the cache and resumes) ends as the straight run."""
    common = [*TINY_RUN, "--parallelism.compile", "true", "--training.steps", "5", "--checkpoint.interval", "2",
              "--checkpoint.keep_last", "0", "--checkpoint.async_save", "false", "--sample.max_new_tokens", "0"]
    straight, faulty = tmp_path / "straight", tmp_path / "faulty"
    proc = run_cli("train", "--run.dir", str(straight), *common, timeout=600)
    assert "compiled (configured)" in proc.stdout
    proc = run_cli("train", "--run.dir", str(faulty), *common, "--launch.max_restarts", "1",
                   "--fault.inject", "exception:rank=0,step=4", timeout=600)
    assert proc.stdout.count("compiled (configured)") == 2
    assert_same_states(straight, faulty)
    a, b = straight / "checkpoints" / "step-5", faulty / "checkpoints" / "step-5"
    assert digest(a, "model.") == digest(b, "model.") and digest(a, "optim.") == digest(b, "optim.")
    summary = json.loads((faulty / "summary.json").read_text())
    assert summary["compiled"] is True and summary["attempts"] == 2
    events = [json.loads(x) for x in (faulty / "events.jsonl").read_text().splitlines()]
    assert [e["resumed_step"] for e in events if e["event"] == "recovered"] == [2]
