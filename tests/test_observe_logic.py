"""Pure-logic tests of the observability building blocks (no processes, no network)."""

import json
import time

import pytest

from stalwart.config import build, undocumented_fields
from stalwart.observe.aggregate import heatmap, load_timings, straggler_scores
from stalwart.config.job import ObserveConfig
from stalwart.observe.diagnose import analyze, format_diagnosis
from stalwart.observe.flight import FlightRecorder
from stalwart.observe.reader import load_run
from stalwart.observe.synthetic import write_synthetic_run
from stalwart.observe.timer import PhaseTimer, TimingsWriter
from stalwart.observe.trace import build_trace, validate_trace

pytestmark = pytest.mark.unit


def rec(step, rank, **phases):
    return {"step": step, "rank": rank, "t_start": 100.0 + step, "step_time_s": sum(phases.values()),
            "phases": phases}


def test_config_section_is_documented_and_validated():
    assert undocumented_fields(ObserveConfig) == []
    cfg = build(ObserveConfig, {"prometheus_port": 9100, "hang_timeout_s": 30})
    assert cfg.prometheus_port == 9100 and cfg.prometheus_host == "127.0.0.1"
    with pytest.raises(ValueError):
        build(ObserveConfig, {"prometheus_port": 70000})


def test_phase_timer_produces_one_record_per_step(tmp_path):
    seen = []
    timer = PhaseTimer(rank=3, sink=TimingsWriter(tmp_path, 3), flush_every=2,
                       on_phase=lambda phase, step: seen.append((phase, step)))
    for step in (1, 2, 3):
        timer.begin_step(step)
        with timer.phase("data"):
            time.sleep(0.002)
        for _ in range(2):  # gradient accumulation: a phase entered twice accumulates
            with timer.phase("forward"):
                time.sleep(0.001)
        r = timer.end_step()
        assert r["step"] == step and r["rank"] == 3
        assert r["phases"]["data"] >= 0.002 and r["phases"]["forward"] >= 0.002
        assert r["step_time_s"] >= r["phases"]["data"] + r["phases"]["forward"]
        assert r["phase_starts"]["data"] <= r["phase_starts"]["forward"]
    assert ("data", 1) in seen and (None, 1) in seen
    assert len(load_timings(tmp_path)) == 2  # flushed every 2 steps, no barrier
    timer.close()
    recs = load_timings(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3] and set(recs[0]["phases"]) == {"data", "forward"}


def test_disabled_timer_is_a_no_op():
    timer = PhaseTimer(enabled=False)
    timer.begin_step(1)
    with timer.phase("forward"):
        pass
    assert timer.end_step() is None


def test_heatmap_matrix_has_rank_rows_and_step_columns():
    recs = [rec(s, r, forward=0.01 * (r + 1)) for s in (1, 2, 3) for r in (0, 1) if not (s == 2 and r == 1)]
    hm = heatmap(recs, "forward")
    assert hm["ranks"] == [0, 1] and hm["steps"] == [1, 2, 3]
    assert hm["matrix"][1] == [0.02, None, 0.02]
    assert heatmap(recs, "step_time_s", last_steps=2)["steps"] == [2, 3]


def test_straggler_scores_flag_slow_rank_not_its_victims():
    recs = []
    for s in range(1, 11):
        recs += [rec(s, 0, forward=0.010, comm=0.030), rec(s, 1, forward=0.030, comm=0.010),
                 rec(s, 2, forward=0.0101, comm=0.030)]
    st = straggler_scores(recs, threshold=1.2)
    fwd = {r["rank"]: r for r in st["rows"] if r["phase"] == "forward"}
    assert fwd[1]["score"] == pytest.approx(3.0) and fwd[1]["flagged"]
    assert not fwd[2]["flagged"]  # 1% slower is noise
    assert st["suspects"] == [1]  # ranks 0 and 2 wait in comm: victims, not stragglers


def test_load_run_from_synthetic_run(tmp_path):
    run = write_synthetic_run(tmp_path / "run", ranks=2, steps=40, failure_at=30)
    data = load_run(run)
    gp = data["goodput"]  # the accounting itself: tests/test_observe_goodput.py
    assert gp["counts"]["failure"] == 1 and len(gp["failures"]) == 1 and 0 < gp["ettr"] < 1
    assert [r["step"] for r in data["train"]] == list(range(1, 41))  # newest record per step
    assert data["stragglers"]["suspects"] == []  # the default slow rank (2) is not in a 2-rank run


def test_foreign_lines_and_files_in_a_run_are_skipped_not_fatal(tmp_path):
    """A line that is JSON but not a record, or a flight file that is not a dump (hand-edited, another
    tool's), is left out by every reader: the views of the run still work."""
    from stalwart.observe.diagnose import load_dumps
    from stalwart.paths import RunPaths

    run = write_synthetic_run(tmp_path / "run", ranks=2, steps=10)
    paths = RunPaths(run)
    before = load_run(run)
    for f in (paths.events, paths.metrics):
        with f.open("a") as fh:
            fh.write('[1, 2]\n"text"\n7\n')
    with paths.timings(0).open("a") as fh:
        fh.write("[3]\n")
    after = load_run(run)
    assert after["train"] == before["train"] and after["goodput"] == before["goodput"]
    paths.flight_dir.mkdir(exist_ok=True)
    (paths.flight_dir / "rank-0.json").write_text("[]")
    (paths.flight_dir / "rank-1.json").write_text('{"rank": "x"}')
    skipped = []
    assert load_dumps(run, skipped) == {} and len(skipped) == 2 and "not a flight-recorder dump" in skipped[0]


def test_trace_export_is_valid_trace_event_json(tmp_path):
    run = write_synthetic_run(tmp_path / "run", ranks=3, steps=30, slow_rank=2)
    trace = build_trace(load_timings(run), 10, 19)
    assert validate_trace(trace) == []
    json.loads(json.dumps(trace))
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in x} == {0, 1, 2}
    assert {e["args"]["step"] for e in x} == set(range(10, 20))
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"step", "forward", "backward", "comm"} <= lanes
    assert min(e["ts"] for e in x) == 0 and all(e["dur"] > 0 for e in x)
    fwd = [e for e in x if e["name"] == "forward" and e["pid"] == 0]
    bwd = [e for e in x if e["name"] == "backward" and e["pid"] == 0]
    assert all(b["ts"] >= f["ts"] + f["dur"] - 1 for f, b in zip(fwd, bwd))  # phases laid out in order
    assert validate_trace({"traceEvents": [{"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": -1}]})


def test_flight_recorder_ring_buffer_watchdog_and_dump(tmp_path):
    now = [1000.0]
    fr = FlightRecorder(0, 2, tmp_path, capacity=16, hang_timeout_s=5, clock=lambda: now[0])
    for i in range(20):
        fr.finish(fr.start("all_reduce", sizes=[[4]], dtype="float32"))
    assert len(fr.entries) == 16 and fr.entries[-1]["seq"] == 19
    p2p = fr.start("send", peer=1)
    fr.finish(p2p)
    assert p2p["seq"] == 0 and p2p["p2p"]
    assert fr.check() is None
    now[0] += 60
    assert fr.check() is None  # not armed: no step has started yet (a long start-up is not a hang)
    fr.mark_progress(1)
    e = fr.start("all_gather_into_tensor", sizes=[[8], [4]])
    now[0] += 6
    assert "all_gather_into_tensor #20" in fr.check()
    fr.finish(e)
    assert fr.check() is None
    now[0] += 6
    assert fr.check().startswith("no progress")
    fr.set_phase("data", step=7)
    assert fr.check() is None
    d = json.loads(fr.dump("test").read_text())
    assert d["reason"] == "test" and d["step"] == 7 and d["phase"] == "data" and len(d["entries"]) == 16


def _dump(rank, entries, t=2000.0, **kw):
    return {"rank": rank, "world_size": 3, "time": t, "reason": "hang", "step": 5, "phase": "comm",
            "phase_since": t - 30, "entries": entries, **kw}


def _e(seq, op="all_reduce", state="completed", t=1900.0, sizes=([4],)):
    return {"id": seq, "seq": seq, "op": op, "group": "default", "group_ranks": [0, 1, 2], "p2p": False,
            "sizes": list(sizes), "t_start": t + seq, "t_end": t + seq + 0.1 if state == "completed" else None,
            "state": state, "step": 5, "phase": "comm"}


def test_diagnose_names_rank_that_never_entered_collective():
    dumps = {0: _dump(0, [_e(0), _e(1), _e(2, state="started")]),
             1: _dump(1, [_e(0), _e(1)], phase="data"),
             2: _dump(2, [_e(0), _e(1), _e(2, state="started")])}
    a = analyze(dumps)
    assert a["suspect_ranks"] == [1]
    f = a["findings"][0]
    assert f["seq"] == 2 and f["never_entered"] == [1] and f["entered"] == [0, 2]
    assert a["ranks"][0]["in_flight"]["seq"] == 2 and a["ranks"][1]["last_completed"]["seq"] == 1
    text = format_diagnosis(a)
    assert "NEVER entered by rank(s) [1]" in text and "collective #2" in text


def test_diagnose_reports_mismatch_and_missing_dump():
    dumps = {0: _dump(0, [_e(0), _e(1, sizes=([4],))]), 1: _dump(1, [_e(0), _e(1, sizes=([8],))])}
    a = analyze(dumps)
    assert a["missing_dumps"] == [2] and 2 in a["suspect_ranks"]
    assert a["mismatches"][0]["seq"] == 1
    assert not a["findings"]


def test_doctor_outlier_rule():
    from stalwart.observe.doctor import flag_outliers

    ranks = [{"rank": r, "matmul_gflops": 100.0, "allreduce_latency_us": 50.0, "ring_gbs": 1.0} for r in range(4)]
    assert flag_outliers(ranks) == []
    ranks[2]["matmul_gflops"] = 60.0
    ranks[3]["allreduce_latency_us"] = 90.0  # 1.8x: communication noise, not flagged
    ranks[1]["ring_gbs"] = 0.4  # 2.5x slower: flagged
    assert {(f["rank"], f["metric"]) for f in flag_outliers(ranks)} == {(2, "matmul_gflops"), (1, "ring_gbs")}


def test_phase_timer_moves_blocked_collective_time_to_comm():
    blocked = [0.0]
    timer = PhaseTimer(comm_clock=lambda: blocked[0])
    timer.begin_step(1)
    with timer.phase("backward"):
        time.sleep(0.01)
        blocked[0] += 0.004  # a reduce-scatter inside backward blocked for 4 ms
    r = timer.end_step()
    assert r["phases"]["comm"] == pytest.approx(0.004)
    assert r["phases"]["backward"] >= 0.0055 and r["phases"]["backward"] < r["step_time_s"] - 0.0039


def test_load_timings_tail_reads_only_recent_steps(tmp_path):
    run = write_synthetic_run(tmp_path / "run", ranks=2, steps=50, failure_at=None)
    recs = load_timings(run, tail_bytes=3000)
    steps = sorted({r["step"] for r in recs})
    assert steps[-1] == 50 and 1 not in steps and len(recs) < 100


def test_phase_timer_cost_is_microseconds(tmp_path):
    from stalwart.bench.observe_overhead import _micro_timer_us

    assert _micro_timer_us(str(tmp_path), steps=2000) < 1000  # ~30-40 us on this machine


def test_cuda_event_path_resolves_at_flush(monkeypatch):
    """The CUDA branch with fake events (no GPU here): nothing is resolved until the flush."""
    clock = [0.0]

    class FakeEvent:
        synced = 0

        def __init__(self):
            clock[0] += 0.005  # each recorded event is 5 ms after the previous one
            self.t = clock[0]

        def elapsed_time(self, other):  # milliseconds, like torch.cuda.Event
            return (other.t - self.t) * 1e3

        def synchronize(self):
            FakeEvent.synced += 1

    monkeypatch.setattr(PhaseTimer, "_event", staticmethod(FakeEvent))
    out = []
    timer = PhaseTimer(rank=1, device="cuda:1", sink=out.extend, flush_every=3)
    for step in range(3):
        timer.begin_step(step)
        with timer.phase("forward"):
            pass
        with timer.phase("backward"):
            pass
        assert timer.end_step() is None
        assert out == [] if step < 2 else len(out) == 3
    assert FakeEvent.synced == 1  # one synchronisation per flush, none per step
    assert out[0]["phases"] == pytest.approx({"forward": 0.005, "backward": 0.005})
    assert out[0]["step_time_s"] == pytest.approx(0.025)



def test_run_history_spans_every_attempt_of_this_run_only():
    from stalwart.train.observer import run_history

    assert run_history([]) == {"started": None, "attempts": 0, "first_eval_loss": None}
    earlier = [{"event": "start", "time": 1.0, "step": 0}, {"event": "eval", "eval_loss": 9.0},
               {"event": "finished", "time": 2.0}]
    run = [{"event": "start", "time": 10.0, "step": 0}, {"event": "eval", "eval_loss": 5.0},
           {"event": "failure"}, {"event": "start", "time": 20.0, "step": 4},
           {"event": "eval", "eval_loss": 4.0}]
    assert run_history(run) == {"started": 10.0, "attempts": 2, "first_eval_loss": 5.0}
    # A fresh start after a finished run begins another run in the same directory.
    assert run_history(earlier + run) == run_history(run)
    # A relaunch that resumes a finished run (more steps) continues it.
    resumed = earlier + [{"event": "start", "time": 5.0, "step": 8}, {"event": "eval", "eval_loss": 3.0}]
    assert run_history(resumed) == {"started": 1.0, "attempts": 2, "first_eval_loss": 9.0}
