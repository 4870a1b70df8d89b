"""What a rerun of a killed `stalwart rl` controller resumes with, without processes: the loop's state
files, the choice of where to resume, pending groups written and read back bit for bit, and the checks
of the steps an earlier session completed."""

import json

import pytest

from stalwart.controller.replay import ReplayDiverged
from stalwart.rl import rollout
from stalwart.rl.state import Checks, StateFiles, group_of, group_record, resume_point
from stalwart.rl.tasks import split

pytestmark = pytest.mark.unit


def test_a_pending_group_is_written_and_read_back_bit_for_bit():
    train, _ = split(0, 0.2)
    (req,) = rollout.plan_step(3, 0, train, 1, 2)
    g = rollout.Group(req, [1, 2, 3], [[4, 5], [6]], [[-0.1 / 3, -1e-300], [float("-inf")]], 2, [[-0.5, -0.25], [-2.0]])
    back = group_of(group_record(g), {i.key: i for i in train})
    assert back == g and back.gid == g.gid and back.request.seeds == req.seeds


def test_state_files_keep_the_newest_and_the_disk_checkpoints(tmp_path):
    files = StateFiles(tmp_path / "rl-state")
    assert files.steps() == [] and files.read(2) is None
    for s in (0, 2, 4, 6, 8):
        files.write({"step": s, "x": s}, keep={2})
    assert files.steps() == [2, 4, 6, 8] and files.read(6) == {"step": 6, "x": 6}


def test_a_rerun_resumes_from_the_newest_state_with_its_loop_state():
    assert resume_point(None, None, [0, 2]) is None
    assert resume_point(4, 2, [0, 2, 4]) == ("memory", 4)
    assert resume_point(4, 2, [0, 2]) == ("disk", 2)      # a snapshot without its loop state is not used
    assert resume_point(None, 2, [2]) == ("disk", 2)
    assert resume_point(2, 2, [2]) == ("memory", 2)       # equal steps: the snapshot, nothing read from disk
    assert resume_point(None, 4, [2]) is None


def test_resumed_steps_must_match_the_journal_in_sync_and_are_reported_in_async():
    earlier = {3: {"issued": {"groups": ["3/0", "3/1"], "versions": [2, 2]},
                   "applied": {"loss": 0.5, "grad_norm": 1.25}}}
    same = ({"groups": ["3/0", "3/1"], "versions": [2, 2]}, {"loss": 0.5, "grad_norm": 1.25})
    events = []
    strict = Checks(earlier, True, lambda *a, **k: events.append(k))
    strict(2, *same)  # not an earlier step: nothing to check
    strict(3, *same)
    assert (strict.matched, strict.differed, events) == (1, 0, [])
    with pytest.raises(ReplayDiverged, match="loss"):
        strict(3, same[0], {"loss": 0.5000001, "grad_norm": 1.25})
    with pytest.raises(ReplayDiverged, match="versions"):
        strict(3, {"groups": ["3/0", "3/1"], "versions": [1, 2]}, same[1])
    lenient = Checks(earlier, False, lambda *a, **k: events.append(k))
    lenient(3, {"groups": ["3/0", "3/1"], "versions": [2, 1]}, same[1])
    assert lenient.differed == 1 and events[-1]["matched"] is False and "versions" in events[-1]["detail"]


def test_a_resumed_run_drops_the_rows_it_computes_again(tmp_path):
    """metrics.jsonl of a controller killed after step 5 and resumed at step 4 (8 steps in all): the warm-up,
    the steps and evaluations up to 4 stay; step 5's row, a torn last line and a final evaluation go."""
    from stalwart.metrics.records import read_jsonl
    from stalwart.rl.state import rewind_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "kind": "sft"}, {"step": 9, "kind": "sft"}, {"step": 0, "kind": "eval"},
            *({"step": s, "kind": "rl", "loss": s / 3} for s in range(1, 6)), {"step": 4, "kind": "eval"},
            {"step": 8, "kind": "eval"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "ki')
    rewind_metrics(path, 4, 8)
    assert read_jsonl(path) == rows[:7] + [rows[8]] and path.read_text().endswith("}\n")
    rewind_metrics(tmp_path / "none.jsonl", 4, 8)  # a run killed before its first row
    assert not (tmp_path / "none.jsonl").exists()
