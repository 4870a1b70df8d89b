"""A fleet of sandbox services under a flood, for real: `stalwart bench sandbox --fleet 3` runs three
`stalwart sandbox serve` processes on emulated hosts (network namespaces), floods them from a client on a
fourth and kills one with SIGKILL mid-flood: no verdict lost or doubled, every verdict equal to local
scoring, the client's rate back within 5 s. The flood table's arithmetic is checked as pure logic."""

import json
import shutil

import pytest
from conftest import run_cli

from stalwart.bench.sandbox_fleet import summarize
from stalwart.comm.netns import unavailable_reason

OK = [1.0, 3, 3, "passed"]
WRONG = [0.0, 0, 3, "case 0: wrong answer"]


@pytest.mark.unit
def test_the_flood_table_counts_lost_doubled_unequal_resent_and_the_recovery():
    expected = [OK, WRONG]
    batches = []
    for s in range(10):  # 10 s at 4 programs/s: one batch of 2 every half second; the kill at 5 s
        for half in (0.0, 0.5):
            first = len(batches) * 2
            if 5.0 <= s + half < 7.0:  # two slow seconds after the kill: one batch a second
                if half:
                    continue
            batches.append((first, 2, 100 + s + half - 0.4, 100 + s + half + 0.3, [OK, WRONG]))
    batches[1] = (2, 2, 100.1, 100.8, [OK, OK])  # number 3's verdict unequal to the local one
    batches[2] = (4, 2, 100.6, 101.3, "SandboxError: nobody")  # a batch never scored: 2 lost
    batches[3] = (0, 2, 101.1, 101.8, [OK, WRONG])  # numbers 0 and 1 answered a second time: doubled
    wire = [("a", 100.0, 100.1, 200, ["x", "y"]), ("b", 105.0, 105.0, "ReadError", ["z"]),
            ("a", 105.1, 105.5, 200, ["z"]), ("b", 108.0, 108.2, 200, ["w"])]
    run = {"start": 100.0, "seconds": 10.0, "batches": batches, "wire": wire}
    out = summarize(run, expected, kill_at=5.0, hosts=["b", "a", "c"], restart_at=7.5)
    assert (out["lost"], out["doubled"], out["unequal"], out["resent"]) == (2, 2, 1, 1)
    assert out["programs"] == 2 * len(batches) and out["scored"] == out["programs"] - 2
    assert out["rate_before_kill"] == 4.0 and out["recovered_at"] == pytest.approx(2.7, abs=0.05)
    # windows of 1 s: 2 programs/s (one batch a second) until the one from 6.9 s holds two batches again
    assert out["lowest_after_kill"] == 2.0 and out["recovery_s"] == pytest.approx(2.9, abs=0.11)
    assert out["restarted_host_back_after_s"] == 0.5
    assert len(out["per_second"]) == 10 and out["per_second"][5] == 2.0


@pytest.mark.e2e
@pytest.mark.skipif(not shutil.which("bwrap") or unavailable_reason() is not None,
                    reason=f"needs bubblewrap and network namespaces ({unavailable_reason()})")
def test_a_fleet_under_a_flood_loses_no_verdict_when_a_service_is_killed():
    bad = run_cli("bench", "sandbox", "--fleet", "3", "--flood-s", "10", "--kill-at", "12", check=False)
    assert bad.returncode == 2 and "--kill-at must lie inside the flood" in bad.stderr
    proc = run_cli("bench", "sandbox", "--fleet", "3", "--flood-s", "10", "--kill-at", "3", "--flood-threads", "9",
                   "--batch", "4")
    row = json.loads(proc.stdout.splitlines()[-1])
    assert row["killed_at"] == pytest.approx(3.0, abs=0.5)
    assert row["programs"] > 0 and row["scored"] == row["programs"]
    assert (row["lost"], row["doubled"], row["unequal"]) == (0, 0, 0), row
    assert row["resent"] > 0, row  # the killed service held batches: they were scored elsewhere, once
    assert row["recovery_s"] is not None and row["recovery_s"] <= 5.0, row
    assert all(n > 0 for n in row["batches_answered_per_host"].values()), row
