"""Goodput: the one accounting (stalwart.observe.goodput), and every view of it giving the same numbers."""

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import cli_env

from stalwart.metrics.records import read_jsonl
from stalwart.observe.goodput import BUCKETS, account, account_run, format_report
from stalwart.observe.reader import load_run
from stalwart.observe.server import serve_in_thread
from stalwart.observe.synthetic import FAILURE, STARTUP_S, write_synthetic_run
from stalwart.paths import RunPaths


def step(s, t, seconds=1.0):
    return {"step": s, "loss": 1.0, "step_time_s": seconds, "time": t}


@pytest.mark.unit
def test_goodput_split():
    events = [
        {"event": "launch", "time": 0.0},
        {"event": "checkpoint_saved", "time": 12.5, "stall_s": 0.5, "async_save": True},
        {"event": "failure", "time": 15.0, "kind": "signal", "rank": 1, "step": 4, "injected": "kill",
         "fault_time": 14.5, "detect_time": 15.0, "detection_latency_s": 0.5, "attempt": 0},
        {"event": "restart", "time": 16.0, "attempt": 1},
        {"event": "resumed", "time": 19.0, "step": 2},
        {"event": "recovered", "time": 21.0, "attempt": 1, "steps_recomputed": 2, "recovery_s": 6.0,
         "fault_to_step_s": 6.5},
        {"event": "supervisor_exit", "time": 26.0},
    ]
    metrics = [step(1, 11), step(2, 12), step(3, 14), step(4, 14.2)] + [step(s, 17 + s) for s in (3, 4, 5, 6)]
    g = account(events, metrics)
    b = g["buckets"]
    assert g["wall_s"] == 26.0
    assert b["startup"] == pytest.approx(10.0)          # launch -> first step starts
    assert b["productive"] == pytest.approx(6.0)        # steps 1, 2 and the final 3..6
    assert b["lost"] == pytest.approx(2.3)              # steps 3, 4 of attempt 0 + 0.3 s until the fault
    assert b["detection"] == pytest.approx(0.5)
    assert b["restart"] == pytest.approx(19.0 - 15.0)   # detection -> first step of attempt 1 starts
    assert b["checkpoint"] == pytest.approx(0.5)
    assert sum(b.values()) == pytest.approx(26.0)
    assert g["ettr"] == pytest.approx(6 / 26)
    assert g["failures"][0]["steps_recomputed"] == 2 and g["failures"][0]["fault_to_step_s"] == 6.5
    assert g["counts"]["restart"] == 1 and g["steps_recomputed"] == 2


@pytest.mark.unit
def test_synthetic_run_with_a_failure(tmp_path):
    run = write_synthetic_run(tmp_path / "run", ranks=2, steps=40, failure_at=30, ckpt_every=20)
    g = account_run(run)
    b = g["buckets"]
    train = [m for m in read_jsonl(RunPaths(run).metrics) if "loss" in m]
    first_try = train[:29]                   # steps 1..29, then the kill during step 30
    newest = {m["step"]: m for m in train}   # steps 21..29 were trained again after resuming at 20
    assert b["detection"] == pytest.approx(FAILURE["detection_s"])
    assert b["restart"] == pytest.approx(FAILURE["stop_s"] + FAILURE["rendezvous_s"] + FAILURE["resume_s"])
    assert b["startup"] == pytest.approx(STARTUP_S + 1.0)  # launch -> start, start -> first step
    assert b["lost"] == pytest.approx(sum(m["step_time_s"] for m in first_try[20:]) + FAILURE["into_step_s"])
    assert b["productive"] == pytest.approx(sum(m["step_time_s"] for m in newest.values()))
    assert b["checkpoint"] == pytest.approx(0.8 * 2)   # synchronous saves at steps 20 and 40
    assert sum(b.values()) == pytest.approx(g["wall_s"], rel=1e-12) and g["ettr"] == b["productive"] / g["wall_s"]
    (f,) = g["failures"]
    assert (f["kind"], f["rank"], f["step"], f["injected"], f["steps_recomputed"]) == ("signal", 1, 29, "kill", 9)
    assert f["detection_latency_s"] == FAILURE["detection_s"] and f["fault_to_step_s"] > f["detection_latency_s"]
    assert g["counts"] == {"failure": 1, "restart": 1, "resumed": 1, "recovered": 1, "checkpoint_saved": 2,
                           "checkpoint_failed": 0}
    text = format_report(g)
    assert f"ETTR            {100 * g['ettr']:.1f}%" in text and "(injected kill)" in text


@pytest.mark.unit
def test_a_step_trained_twice_counts_once_without_a_supervisor():
    # A run stopped after step 4 and started again by hand from its checkpoint at step 2: no failure event.
    events = [{"event": "start", "time": 0.0}, {"event": "resumed", "time": 10.0, "step": 2},
              {"event": "start", "time": 10.5}]
    metrics = [step(s, s + 0.0) for s in (1, 2, 3, 4)] + [step(s, 9.0 + s) for s in (3, 4, 5)]
    g = account(events, metrics)
    assert g["buckets"]["productive"] == pytest.approx(5.0) and g["buckets"]["lost"] == pytest.approx(2.0)
    assert g["wall_s"] == 14.0 and g["failures"] == []


@pytest.mark.unit
def test_a_logged_step_stands_for_the_unlogged_steps_before_it():
    # metrics.log_interval = 5: each line's step time stands for five steps; the last line for two.
    events = [{"event": "launch", "time": 0.0}, {"event": "supervisor_exit", "time": 20.0}]
    metrics = [step(5, 6.0), step(10, 11.0), step(12, 13.0)]
    g = account(events, metrics)
    assert g["buckets"]["productive"] == pytest.approx(12.0)
    assert g["buckets"]["startup"] == pytest.approx(1.0)
    # never more than the time since the previous line, however long the logged step took
    g = account(events, [step(5, 6.0), step(10, 7.0, seconds=0.5)])
    assert g["buckets"]["productive"] == pytest.approx(5.0 + 1.0)


def _two_launches() -> tuple[list[dict], list[dict]]:
    """A run directory's records after a relaunch: launch 1 restarts once (rank 1 killed), then loses a
    host and ends with 77; launch 2 (fewer processes, the same run directory, attempts from 0 again)
    restarts once more (rank 0 killed). Both launches have a recovery of attempt 1."""
    t = 1000.0
    events = [
        {"event": "launch", "time": t},
        {"event": "failure", "time": t + 20, "kind": "signal", "rank": 1, "step": 10, "attempt": 0,
         "fault_time": t + 19.5, "detect_time": t + 20, "detection_latency_s": 0.5, "decision": "restart"},
        {"event": "restart", "time": t + 21, "attempt": 1},
        {"event": "resumed", "time": t + 23, "step": 8},
        {"event": "recovered", "time": t + 25.4, "attempt": 1, "recovery_s": 5.4, "fault_to_step_s": 5.9,
         "steps_recomputed": 2},
        {"event": "failure", "time": t + 40, "kind": "signal", "rank": 3, "step": 20, "attempt": 1,
         "fault_time": t + 39.7, "detect_time": t + 40, "detection_latency_s": 0.3, "decision": "exclude"},
        {"event": "supervisor_exit", "time": t + 41, "code": 77},
        {"event": "launch", "time": t + 45},
        {"event": "resumed", "time": t + 48, "step": 16},
        {"event": "failure", "time": t + 60, "kind": "signal", "rank": 0, "step": 25, "attempt": 0,
         "fault_time": t + 59, "detect_time": t + 60, "detection_latency_s": 1.0, "decision": "restart"},
        {"event": "restart", "time": t + 61, "attempt": 1},
        {"event": "resumed", "time": t + 62, "step": 24},
        {"event": "recovered", "time": t + 62.81, "attempt": 1, "recovery_s": 2.81, "fault_to_step_s": 3.81,
         "steps_recomputed": 1},
        {"event": "supervisor_exit", "time": t + 70, "code": 0},
    ]
    metrics = ([step(s, t + 9 + s) for s in range(1, 11)] + [step(s, t + 16.4 + s) for s in range(9, 21)]
               + [step(s, t + 32 + s) for s in range(17, 26)] + [step(s, t + 38.81 + s) for s in range(25, 31)])
    return events, metrics


@pytest.mark.e2e
def test_each_failure_gets_its_own_recovery_across_launches(tmp_path):
    """`stalwart goodput` (and the end-of-run summary, the same calculation) pairs each failure with the
    recovery that followed it, though attempt 1 of both launches recovered: by time, not attempt number."""
    from conftest import run_cli

    events, metrics = _two_launches()
    g = account(events, metrics)
    assert [(f["rank"], f["fault_to_step_s"], f["recovery_s"], f["steps_recomputed"]) for f in g["failures"]] == [
        (1, 5.9, 5.4, 2), (3, None, None, None), (0, 3.81, 2.81, 1)]
    assert g["steps_recomputed"] == 3
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    for path, rows in ((paths.events, events), (paths.metrics, metrics)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run_cli("goodput", str(paths.root)).stdout
    lines = [x.strip() for x in out.splitlines() if "detected in" in x]
    assert lines == ["signal       rank 1 step 10    detected in 0.50 s, next step after 5.90 s, 2 recomputed",
                     "signal       rank 3 step 20    detected in 0.30 s, next step after -, - recomputed",
                     "signal       rank 0 step 25    detected in 1.00 s, next step after 3.81 s, 1 recomputed"], out
    assert json.loads(run_cli("goodput", str(paths.root), "--json").stdout)["failures"] == g["failures"]


@pytest.mark.unit
def test_no_events_no_accounting(tmp_path):
    assert account([], [step(1, 1.0)]) is None
    assert account_run(tmp_path) is None


def _stalwart(*args):
    """The installed console script, as a user runs it."""
    exe = Path(sys.executable).with_name("stalwart")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "stalwart"]
    proc = subprocess.run(cmd + list(args), capture_output=True, text=True, env=cli_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.e2e
def test_dashboard_cli_and_account_run_agree(tmp_path):
    """One calculation: the dashboard's data (direct and over HTTP), `stalwart goodput` and account_run."""
    run = write_synthetic_run(tmp_path / "run", ranks=4, steps=60, failure_at=35)
    g = account_run(run)
    assert g["failures"] and g["buckets"]["lost"] > 0 and g["buckets"]["detection"] > 0
    server, url = serve_in_thread(run)
    try:
        over_http = json.loads(urllib.request.urlopen(url + "api/goodput", timeout=10).read())["goodput"]
    finally:
        server.shutdown()
        server.server_close()
    as_json = json.loads(_stalwart("goodput", str(run), "--json"))
    for view in (load_run(run)["goodput"], over_http, as_json):
        assert view["ettr"] == g["ettr"] and view["wall_s"] == g["wall_s"]
        assert list(view["buckets"]) == list(BUCKETS) and view["buckets"] == g["buckets"]
        assert view["failures"] == g["failures"] and view["counts"] == g["counts"]
    assert _stalwart("goodput", str(run)).strip() == format_report(g)
