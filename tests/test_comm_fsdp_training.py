"""`stalwart train --comm.algorithm ...`: FSDP's collectives through our algorithms, same losses."""

import json

import pytest

from conftest import TINY_RUN, run_cli, step_losses

pytestmark = pytest.mark.e2e


def train(run_dir, nproc, *extra):
    run_cli("train", "--run.dir", str(run_dir), *TINY_RUN, "--training.steps", "4", "--training.global_batch", "6", "--training.micro_batch", "1",
            "--checkpoint.at_end", "false", "--sample.max_new_tokens", "0", "--nproc-per-node", str(nproc), *extra)


@pytest.mark.parametrize("nproc,algorithm", [(2, "ring"), (3, "auto")])
def test_custom_fsdp_collectives_give_the_same_losses(tmp_path, nproc, algorithm):
    train(tmp_path / "builtin", nproc)
    train(tmp_path / "custom", nproc, "--comm.algorithm", algorithm, "--comm.placement", "block")
    events = [json.loads(x) for x in (tmp_path / "custom" / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    assert start["collectives"] == algorithm and start["custom_comm_modules"] >= 3  # blocks + root
    want, got = step_losses(tmp_path / "builtin"), step_losses(tmp_path / "custom")
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert abs(want[step] - got[step]) <= 1e-5 * abs(want[step]), (step, want[step], got[step])
    # By default each block's all-gather runs on the comm thread while the previous block computes; the
    # same algorithms issued synchronously (--comm.overlap false) give the same bits.
    ran = json.loads((tmp_path / "custom" / "summary.json").read_text())["custom_collectives"]
    assert ran["overlapped"] > 0 and ran["launched"] > ran["overlapped"], ran
    train(tmp_path / "sync", nproc, "--comm.algorithm", algorithm, "--comm.placement", "block", "--comm.overlap", "false")
    assert json.loads((tmp_path / "sync" / "summary.json").read_text())["custom_collectives"]["overlapped"] == 0
    assert step_losses(tmp_path / "sync") == got


def test_ddp_buckets_through_the_custom_algorithms_on_the_comm_thread(tmp_path):
    """The replicated layout (DDP): each gradient bucket's all-reduce runs on the comm thread with the
    chosen algorithm while backward goes on; two replicas add in one order whatever the algorithm, so
    the losses equal the built-in all-reduce's bit for bit, synchronous or not."""
    replicate = ("--parallelism.data_parallel", "replicate")
    train(tmp_path / "builtin", 2, *replicate)
    train(tmp_path / "custom", 2, *replicate, "--comm.algorithm", "ring")
    start = next(json.loads(x) for x in (tmp_path / "custom" / "events.jsonl").read_text().splitlines()
                 if json.loads(x)["event"] == "start")
    assert start["collectives"] == "ring" and start["custom_comm_modules"] == 1
    ran = json.loads((tmp_path / "custom" / "summary.json").read_text())["custom_collectives"]
    assert ran["launched"] == ran["overlapped"] >= 4, ran  # every bucket of every step, asynchronously
    assert step_losses(tmp_path / "custom") == step_losses(tmp_path / "builtin")
    train(tmp_path / "sync", 2, *replicate, "--comm.algorithm", "ring", "--comm.overlap", "false")
    assert json.loads((tmp_path / "sync" / "summary.json").read_text())["custom_collectives"]["overlapped"] == 0
    assert step_losses(tmp_path / "sync") == step_losses(tmp_path / "builtin")
