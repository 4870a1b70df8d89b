"""parallelism.islands through the CLI: 2 islands of 2 processes (Streaming DiLoCo, 2 fragments, a sync
overlapping one inner step, int8 outer gradients; a snapshot every 10 steps, a sync every 5). A rank of
island 0 killed while its sync is in flight, then every rank of island 1 killed: each island restarts
alone from its own snapshot, behind syncs the other finished, is sent their results, and every logged
step's loss, weights and optimizer state (inner and outer) equal the undisturbed run's."""

from pathlib import Path

import pytest
from conftest import TINY_RUN, read_metrics, run_cli

from stalwart.metrics.records import read_jsonl

STEPS = 40
JOB = [*TINY_RUN, "--training.global_batch", "8", "--training.micro_batch", "2", "--nproc-per-node", "4",
       "--parallelism.islands", "2", "--islands.algorithm", "streaming", "--islands.fragments", "2",
       "--islands.inner_steps", "10", "--islands.overlap_steps", "1", "--islands.quantize", "int8",
       "--islands.block", "64", "--training.steps", str(STEPS), "--checkpoint.interval", "0",
       "--checkpoint.memory_interval", "10", "--fault.heartbeat_timeout_s", "2",
       "--parallelism.data_parallel", "replicate"]


def _island(run: Path, i: int) -> Path:
    return run if i == 0 else run / "groups" / str(i)


def _state(run: Path) -> dict[int, tuple]:
    return {m["step"]: (m["loss"], m["fingerprint_parts"]["params"], m["fingerprint_parts"]["optim"])
            for m in read_metrics(run) if "fingerprint_parts" in m}


@pytest.mark.e2e
def test_islands_recover_alone_and_stay_bitwise(tmp_path):
    ref, run = tmp_path / "reference", tmp_path / "faults"
    run_cli("train", *JOB, "--run.dir", str(ref), timeout=600)
    # job rank = island * 2 + rank: rank 1 of island 0 before step 16 (the sync launched after step 15 is
    # in flight, applied after 16), then both ranks of island 1 before step 27.
    run_cli("train", *JOB, "--run.dir", str(run), "--fault.inject", "kill:rank=1,step=16;kill:rank=2,step=27;"
            "kill:rank=3,step=27", timeout=600)
    caught_up = 0
    for i in range(2):
        want, got = _state(_island(ref, i)), _state(_island(run, i))
        assert sorted(want) == list(range(1, STEPS + 1))
        assert STEPS in got and all(got[s] == want[s] for s in got), f"island {i} differs first at step " + str(
            min(s for s in got if got[s] != want[s]))
        events = read_jsonl(_island(run, i) / "events.jsonl")
        # Each island restarted once, for its own fault: the other's loss did not restart it.
        assert sum(e["event"] == "restart" for e in events) == 1, i
        syncs = [e for e in events if e["event"] == "island_sync"]
        assert syncs and syncs[-1]["index"] >= 7
        caught_up += sum(e["caught_up"] for e in syncs)
    assert caught_up >= 1  # a restored island was behind a sync the other had finished
    # The islands end on one global model (the final sync takes it whole).
    assert _state(ref)[STEPS][1] == _state(_island(ref, 1))[STEPS][1]


@pytest.mark.e2e
def test_islands_refuse_layouts_they_cannot_run(tmp_path):
    for extra, words in (
            (["--nproc-per-node", "3"], "do not split into 2 islands"),
            (["--islands.fragments", "3"], "multiple of islands.fragments"),
            (["--parallelism.data_parallel", "shard"], "holds the whole model"),
            (["--training.global_batch", "6"], "split into 2 islands")):
        r = run_cli("train", *JOB, "--run.dir", str(tmp_path / "r"), *extra, check=False)
        assert r.returncode == 2 and words in r.stderr, (extra, r.stderr[-500:])
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
