"""The restore watch without processes: when a restored source is demoted, and that the count of a
rollback policy's non-finite steps survives the restarts between them."""

import math

import pytest

from stalwart.paths import RunPaths
from stalwart.train.demotion import RestoreWatch, read_demoted

pytestmark = pytest.mark.unit

NAN = {"loss": math.nan, "grad_norm": math.nan}
GOOD = {"loss": 2.5, "grad_norm": 1.0}


def _watch(tmp_path, after=3, events=None):
    paths = RunPaths(tmp_path)
    paths.ft_dir.mkdir(parents=True, exist_ok=True)
    return RestoreWatch(paths, True, after, lambda name, **f: (events if events is not None else []).append(name))


def test_k_non_finite_steps_in_a_row_demote_a_finite_one_ends_the_watch(tmp_path):
    events = []
    w = _watch(tmp_path, after=3, events=events)
    w.restored("memory", 12)
    assert not w.step_done(NAN) and w.suspect and not w.step_done({"loss": 1.0, "grad_norm": math.inf})
    assert w.step_done(NAN)  # the third: demote now
    entry = w.demote()
    assert (entry["source"], entry["step"], entry["bad_steps"]) == ("memory", 12, 3) and events == ["source_demoted"]
    assert w.steps("memory") == {12} and not w.suspect
    assert [d["step"] for d in read_demoted(RunPaths(tmp_path))] == [12]
    w.restored("disk", 10)
    assert not w.step_done(NAN) and not w.step_done(GOOD) and not w.suspect  # a finite step: healthy
    assert not w.step_done(NAN)  # no longer watching
    assert _watch(tmp_path).steps("disk") == set() and _watch(tmp_path).steps("memory") == {12}


def test_rollback_restarts_keep_counting_the_same_source(tmp_path):
    for attempt in range(2):  # each restart is a new process restoring the same checkpoint
        w = _watch(tmp_path, after=3)
        w.restored("disk", 8)
        w.rolled_back()
        assert w.source is not None and w.source["bad"] == attempt + 1
    w = _watch(tmp_path, after=3)
    w.restored("disk", 8)
    w.rolled_back()  # the third non-finite step since this restore
    assert w.steps("disk") == {8} and not RunPaths(tmp_path).restore_watch.exists()
    w.restored("disk", 6)  # another source starts from zero
    assert w.source["bad"] == 0


def test_off_watches_nothing(tmp_path):
    w = _watch(tmp_path, after=0)
    w.restored("disk", 4)
    assert not w.step_done(NAN) and not w.suspect
