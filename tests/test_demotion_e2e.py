"""A restored state that goes non-finite is demoted, said so, and never restored again: through the CLI."""

import json

import pytest
from conftest import TINY_RUN, run_cli

pytestmark = pytest.mark.e2e


def _events(run, name: str) -> list[dict]:
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == name]


def test_a_poisoned_checkpoint_is_demoted_and_the_run_goes_on_from_an_older_one(tmp_path):
    run = tmp_path / "run"
    common = [*TINY_RUN, "--training.steps", "10", "--checkpoint.interval", "2", "--sample.max_new_tokens", "0"]
    # Non-finite updates applied (nonfinite = off): the checkpoint of step 4 holds NaN weights.
    run_cli("train", "--run.dir", str(run), *common, "--training.stop_at_step", "4", "--fault.nonfinite", "off",
            "--fault.inject", "nan:step=4")
    proc = run_cli("train", "--run.dir", str(run), *common, "--checkpoint.demote_after", "2")
    assert [(e["source"], e["step"]) for e in _events(run, "resumed")] == [("disk", 4), ("disk", 2)]
    (demoted,) = _events(run, "source_demoted")
    assert (demoted["source"], demoted["step"], demoted["bad_steps"]) == ("disk", 4, 2)
    assert "the 2 steps after restoring the disk state of step 4 all went non-finite" in proc.stderr
    assert json.loads((run / "ft" / "demoted.json").read_text())["demoted"][0]["step"] == 4
    last = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if m.get("step") == 10 and "loss" in m]
    assert last and last[-1]["loss"] == last[-1]["loss"]  # finite again: the run went on from step 2
    # A later restart (a new process) still passes over the demoted checkpoint.
    from stalwart.paths import RunPaths
    from stalwart.train.demotion import RestoreWatch

    assert RestoreWatch(RunPaths(run), True, 2, lambda *a, **k: None).steps("disk") == {4}
