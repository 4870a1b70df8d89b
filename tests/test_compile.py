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
    assert on and "1.25x" in why and "start-up 4.0 s per start, cached, 60.0 s first" in why
    assert not choose_compile(fast, 4, 100)[0]  # 2.4 s saved: the start-up is not repaid
    assert not choose_compile(BlockTimes(0.030, 0.029, 60.0, 4.0), 4, 10**6)[0]  # 1.03x: not worth it
    on, why = choose_compile(BlockTimes(0.001), 4, 10)
    assert not on and "under the 60 s it takes" in why


@pytest.mark.unit
def test_auto_counts_the_start_up_a_new_process_pays():
    """A second compile in the measuring process (``warm_s``) costs a fraction of what each start of a
    run pays in a new process (``start_s``): the decision takes the larger. The 2-process debug run of
    400 steps (2 blocks a step) measured here: 0.24 s in-process, 3.1 s in a new process, and a block
    1.17x faster compiled saving ~0.7 s: eager, where the in-process figure alone said compile."""
    t = BlockTimes(eager_s=0.0060, compiled_s=0.0051, first_s=31.8, warm_s=0.24, start_s=3.1)
    assert t.startup_s == 3.1 and BlockTimes(0.006, 0.005, 30.0, 0.5).startup_s == 0.5
    on, why = choose_compile(t, blocks_per_step=2, steps=400)
    assert not on and "start-up 3.1 s per start" in why and "does not repay it" in why, why
    assert choose_compile(BlockTimes(0.0060, 0.0051, 31.8, 0.24), 2, 400)[0]  # what the in-process figure said
    assert choose_compile(t, 2, 10_000)[0]  # ~18 s saved over 10,000 steps repays it


@pytest.mark.unit
def test_a_measurement_without_the_new_process_start_up_is_taken_again(tmp_path, monkeypatch):
    """A cached compiled measurement from before ``start_s`` existed held a start-up far too low: it is
    measured again (once), and the new figure is cached with it."""
    from stalwart.train import compile_choice

    cache = PeakCache(tmp_path / "peaks.json")
    cpu, args = torch.device("cpu"), FLAVORS["debug"]
    key = compile_choice._block_key(cpu, torch.bfloat16, args, 4, 64, "none", cast=True)
    for name, value in (("eager_s", 0.006), ("compiled_s", 0.0051), ("first_s", 31.8), ("warm_s", 0.24)):
        cache.store(f"{key}|{name}", value)
    calls = []

    def measured(*a, **k):
        calls.append(a)
        return BlockTimes(0.006, 0.0051, 3.0, 0.24, 3.1)

    monkeypatch.setattr(compile_choice, "measure_block", measured)
    t = block_times(args, 4, 64, torch.bfloat16, "none", cpu, 2, 10_000, cache, cast=True)
    assert t.start_s == 3.1 and len(calls) == 1 and cache.load()[f"{key}|start_s"] == 3.1
    assert block_times(args, 4, 64, torch.bfloat16, "none", cpu, 2, 10_000, cache, cast=True) == t
    assert len(calls) == 1  # cached now


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_a_new_process_pays_more_for_a_compiled_start_than_a_second_compile_in_one():
    """The measurement ``auto`` makes: a compiled block's start-up in a new process (the cache warm)
    against a second compile in the measuring process, which keeps Dynamo's and Inductor's set-up."""
    from stalwart.train.compile_choice import measure_block, use_compile_cache

    use_compile_cache()
    torch.set_num_threads(1)
    t = measure_block(FLAVORS["debug"], 2, 32, torch.bfloat16, "none", torch.device("cpu"), True, cast=True)
    assert t.eager_s > 0 and t.compiled_s > 0 and t.warm_s > 0
    assert t.start_s > t.warm_s and t.startup_s == t.start_s, t


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
