"""`stalwart train --model.flavor debug-moe` end to end: routing telemetry in metrics.jsonl, and a checkpoint
saved under expert parallelism (ep=2) resumes under ep=1 and ep=4 with the losses of the unbroken run."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import TINY_RUN, run_cli, step_losses

pytestmark = pytest.mark.e2e


def _train(run_dir, nproc, *extra):
    return run_cli("train", "--run.dir", str(run_dir), *TINY_RUN, "--model.flavor", "debug-moe",
                   "--model.moe_bias_rate", "0.001", "--model.moe_aux_loss", "0.01", "--nproc-per-node", str(nproc),
                   "--training.global_batch", "4", "--training.micro_batch", "1", "--training.steps", "4",
                   "--checkpoint.interval", "2", "--sample.max_new_tokens", "0", *extra)


def test_moe_checkpoint_reshards_across_expert_parallel_degrees(tmp_path):
    straight = tmp_path / "ep2"
    _train(straight, 2, "--parallelism.ep", "2")
    records = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    counts = last["moe_tokens_per_expert"]
    assert sorted(counts) == ["1", "2", "3"]  # layer 0 is dense
    assert all(sum(c) == 4 * 32 * 2 for c in counts.values())  # every token reaches top-2 experts, none dropped
    assert last["moe_aux_loss"] > 0 and last["moe_load_imbalance"] >= 1.0 and last["moe_a2a_s"] > 0
    assert any(b != 0 for b in last["moe_expert_bias"]["1"])  # balancing moved the bias

    want = step_losses(straight)
    for name, nproc in (("ep1", 1), ("ep4", 4)):
        resumed = tmp_path / name
        shutil.copytree(straight, resumed)
        shutil.rmtree(resumed / "checkpoints" / "step-4")
        (resumed / "checkpoints" / "latest").write_text("step-2\n")
        _train(resumed, nproc, "--parallelism.ep", str(nproc))
        events = [json.loads(x) for x in (resumed / "events.jsonl").read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "resumed"][-1] == 2
        got = step_losses(resumed)
        for step in (3, 4):  # same weights, experts, biases, optimizer state and data after the reshard
            assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (name, step, want[step], got[step])
