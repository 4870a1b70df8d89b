"""Resharding: a checkpoint saved by one layout resumes under another with the same next-step loss."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import TINY_RUN, run_cli, step_losses

pytestmark = pytest.mark.e2e


def _train(run_dir, nproc, *extra):
    return run_cli("train", "--run.dir", str(run_dir), *TINY_RUN, "--nproc-per-node", str(nproc),
                   "--training.steps", "5", "--checkpoint.interval", "4", "--sample.max_new_tokens", "0", *extra)


REPLICATE = ("--parallelism.data_parallel", "replicate")


@pytest.mark.parametrize("saved_with,resumed_with", [((2,), (1,)), ((1,), (2,)), ((2, *REPLICATE), (2,))],
                         ids=["fsdp2-to-1", "1-to-fsdp2", "ddp2-to-fsdp2"])
def test_checkpoint_reshards_between_layouts(tmp_path, saved_with, resumed_with):
    straight, resharded = tmp_path / "straight", tmp_path / "resharded"
    _train(straight, *saved_with)
    shutil.copytree(straight, resharded)
    shutil.rmtree(resharded / "checkpoints" / "step-5")
    (resharded / "checkpoints" / "latest").write_text("step-4\n")
    _train(resharded, *resumed_with)
    events = [json.loads(x) for x in (resharded / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed[-1]["step"] == 4 and resumed[-1]["source"] == "disk"
    a, b = step_losses(straight)[5], step_losses(resharded)[5]
    # Same weights, optimizer state and data; only the reduction order of the new layout differs.
    assert abs(a - b) <= 1e-5 * abs(a), (a, b)
