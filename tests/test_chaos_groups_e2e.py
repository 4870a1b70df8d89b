"""`stalwart chaos` against a job of replica groups (`fault.group_recovery`), through the CLI: faults aimed
across both groups of a 2-process job, one group's ranks all killed at once, and every group's at once
(the whole-job fallback); the drill trains its own grouped reference and must find every group's steps
equal to it and the groups a fault did not hit never restarted."""

import json

import pytest
from conftest import TINY_RUN, run_cli

pytestmark = pytest.mark.e2e

STEPS = 200
JOB = [*TINY_RUN, "--nproc-per-node", "2", "--parallelism.dp_replicate", "2", "--training.elastic_exact", "true",
       "--fault.group_recovery", "true", "--training.steps", str(STEPS), "--checkpoint.interval", "0",
       "--checkpoint.memory_interval", "1", "--sample.max_new_tokens", "0", "--fault.heartbeat_interval_s", "0.2",
       "--fault.heartbeat_timeout_s", "2", "--fault.rejoin_timeout_s", "60", "--launch.max_restarts", "5"]
KINDS = ("kill", "stop", "group_kill", "all_groups")


def test_chaos_against_replica_groups_restarts_only_the_groups_it_hits_and_ends_bitwise(tmp_path):
    run = tmp_path / "chaos"
    proc = run_cli("chaos", "--faults", str(len(KINDS)), "--kinds", ",".join(KINDS), "--seed", "2", "--gap",
                   "0.2-0.4", "--timeout", "240", "--", *JOB, "--run.dir", str(run), check=False, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "identical: every group's logged steps" in proc.stdout and "survivors' wait" in proc.stdout
    rows = [json.loads(x) for x in (run / "chaos.jsonl").read_text().splitlines()]
    faults, result = rows[:-1], rows[-1]
    assert result["result"] == "equal" and result["survivor_restarts"] == 0 and not result["problems"], result
    by_kind = {f["kind"]: f for f in faults}
    assert sorted(by_kind) == sorted(KINDS) and all(f["sent"] and f["survivor_restarts"] == 0 for f in faults)
    for kind in ("kill", "stop", "group_kill"):
        f = by_kind[kind]
        survivor = 1 - f["group"]
        assert f["groups"] == [f["group"]] and f["restarts"] == 1, f  # the group hit, and only it
        assert f["detected_as"]["group"] == f["group"] and f["detected_as"]["decision"] == "restart", f
        assert [s["group"] for s in f["survivor_stall"]] == [survivor] and f["survivor_stall"][0]["wait_s"] >= 0, f
        assert {"event": "lost", "group": f["group"]}.items() <= f["lighthouse"][0].items(), f
        assert f["lighthouse"][-1]["event"] == "rejoined", f
    assert by_kind["kill"]["detected_as"]["rank"] == by_kind["kill"]["target"]["rank"]
    assert "pids" not in by_kind["group_kill"]  # a group of one rank: one pid, the target's
    everyone = by_kind["all_groups"]
    assert everyone["groups"] == [0, 1] and len(everyone["pids"]) == 2 and everyone["restarts"] == 2, everyone
    assert everyone["survivor_stall"] == [] and {"event": "whole_job_fallback"} in everyone["lighthouse"], everyone
    assert result["restarts_per_group"] == {
        str(g): sum(g in f["groups"] for f in faults) for g in (0, 1)}, (result, faults)
