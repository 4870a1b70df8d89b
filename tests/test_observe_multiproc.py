"""Real 2-process gloo runs: the flight recorder catches a rank that skips a collective (and
``stalwart diagnose`` names it), FSDP2's collectives are recorded, and the straggler score finds a
rank slowed by sleep. Each rank runs this file as a script (``python test_observe_multiproc.py worker``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

SLOW_RANK, SKIP_RANK, STEPS = 1, 1, 6


def _worker(rank: int, world: int, port: int, run_dir: str) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from stalwart.observe import FlightRecorder, PhaseTimer, TimingsWriter

    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    rec = FlightRecorder(rank, world, run_dir, hang_timeout_s=1.5).install()
    timer = PhaseTimer(rank, "cpu", TimingsWriter(run_dir, rank), flush_every=4, on_phase=rec.set_phase,
                       comm_clock=rec.blocked_seconds)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    fully_shard(model)  # FSDP2: all_gather / reduce_scatter through torch.distributed
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, STEPS + 1):
        timer.begin_step(step)
        with timer.phase("data"):
            x = torch.randn(8, 32)
        with timer.phase("forward"):
            loss = model(x).square().mean()
            if rank == SLOW_RANK:
                time.sleep(0.06)  # the straggler
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("comm"):
            t = torch.tensor([loss.item()])
            dist.all_reduce(t)
        with timer.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        timer.end_step()
        rec.mark_progress(step)
    timer.close()
    # The injected bug: SKIP_RANK skips one all_reduce and sits in its data loader instead.
    rec.set_phase("data" if rank == SKIP_RANK else "comm", STEPS + 1)
    if rank == SKIP_RANK:
        time.sleep(4.0)  # the watchdog (1.5 s) dumps "no progress" meanwhile
        rec.dump("SIGUSR1-equivalent final dump")
        os._exit(0)  # leaves the group: the peer's pending all_reduce fails
    try:
        dist.all_reduce(torch.ones(1000))  # blocks: the peer never enters it
    except Exception:
        return 3  # the recorder has dumped on the exception
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hung") / "run"
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(r), "2", str(port), str(run_dir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        outs.append((p.returncode, out))
    return run_dir, outs


def test_flight_recorder_dumps_and_diagnose_names_skipping_rank(hung_run, capsys):
    run_dir, outs = hung_run
    assert outs[0][0] == 3, outs[0][1][-3000:]  # rank 0's all_reduce failed once the peer left
    assert outs[1][0] == 0, outs[1][1][-3000:]
    d0 = json.loads((run_dir / "flight" / "rank-0.json").read_text())
    d1 = json.loads((run_dir / "flight" / "rank-1.json").read_text())
    ops = {e["op"] for e in d0["entries"]}
    assert {"all_gather_single", "reduce_scatter_single", "all_reduce"} <= ops, ops  # FSDP2's collectives too
    last0 = d0["entries"][-1]
    assert last0["op"] == "all_reduce" and last0["state"] == "failed" and last0["sizes"] == [[1000]]
    assert "raised" in d0["reason"]
    assert d1["entries"][-1]["state"] == "completed" and d1["phase"] == "data"
    # the watchdogs fired before: rank 0 saw its all_reduce hang, rank 1 saw no progress
    assert any(r.startswith("hang: all_reduce") for r in d0["earlier_reasons"]), d0["earlier_reasons"]
    assert any(r.startswith("no progress") for r in d1["earlier_reasons"]), d1["earlier_reasons"]

    from stalwart.cli.diagnose import main
    from stalwart.observe.diagnose import analyze, load_dumps

    a = analyze(load_dumps(run_dir))
    assert a["suspect_ranks"] == [SKIP_RANK]
    f = a["findings"][0]
    assert f["never_entered"] == [SKIP_RANK] and f["entered"] == [0] and f["op"] == "all_reduce"
    assert main([str(run_dir)]) == 1
    text = capsys.readouterr().out
    assert f"NEVER entered by rank(s) [{SKIP_RANK}]" in text and "phase data" in text
    print(text)


def test_straggler_report_finds_the_slept_rank(hung_run):
    from stalwart.observe.aggregate import load_timings, straggler_scores

    run_dir, _ = hung_run
    recs = load_timings(run_dir)
    assert {(r["rank"], r["step"]) for r in recs} == {(r, s) for r in (0, 1) for s in range(1, STEPS + 1)}
    st = straggler_scores(recs, threshold=1.5, min_abs_s=0.02)  # the injected 60 ms, not machine noise
    assert st["suspects"] == [SLOW_RANK], st
    fwd = {r["rank"]: r for r in st["rows"] if r["phase"] == "forward"}
    assert fwd[SLOW_RANK]["score"] > 2 and fwd[SLOW_RANK]["flagged"]
    comm = {r["rank"]: r["median_s"] for r in st["rows"] if r["phase"] == "comm"}
    assert comm[0] > comm[SLOW_RANK]  # rank 0 waits for the straggler in comm


def test_doctor_flags_a_slow_rank():
    from stalwart.observe.doctor import format_report, health_check

    rep = health_check(nproc=2, matmul_n=256, mb=1, iters=4, slow_rank=1, timeout_s=60)
    assert rep.errors == [] and len(rep.ranks) == 2, format_report(rep)
    slow = {f["rank"] for f in rep.flags if f["metric"] == "matmul_gflops"}
    assert not rep.ok and slow == {1}, format_report(rep)
    assert all(r["allreduce_latency_us"] > 0 for r in rep.ranks)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.exit(_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
