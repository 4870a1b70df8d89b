"""One live two-rank training run through the CLI: each rank's Prometheus endpoint is scraped and parsed
while it trains, then its profiler traces are opened and found linked from the report."""

import json
import subprocess
import time

import pytest

from conftest import TINY_RUN, popen_cli, run_cli
from stalwart.comm.launch import free_port
from test_observe_sinks import scrape

pytestmark = pytest.mark.e2e


def test_two_ranks_export_prometheus_and_write_profiler_traces(tmp_path):
    port = free_port()
    run = tmp_path / "run"
    proc = popen_cli(
        "train", "--run.dir", str(run), *TINY_RUN, "--nproc-per-node", "2",
        "--training.steps", "16", "--checkpoint.interval", "0", "--checkpoint.at_end", "false",
        "--observe.prometheus_port", str(port), "--observe.timings_flush_every", "2", "--profile.steps", "3-4",
        # steps 5-16 are slowed down so the endpoints are scraped while the run trains
        "--fault.inject", "slow:rank=0,factor=4,steps=5-16",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, got = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                got = [scrape(port), scrape(port + 1)]
            except OSError:
                got = None
            if got and all(any(n == "stalwart_train_phase_seconds_total" for n, _ in g) for g in got):
                break
            time.sleep(0.3)
        stdout, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stdout[-3000:]
    assert got is not None, stdout[-3000:]
    run_labels = {"run": "run", "run_dir": str(run.resolve())}
    for rank, series in enumerate(got):
        assert {dict(k)["rank"] for n, k in series if n == "stalwart_train_step_duration_seconds"} == {str(rank)}
        phases = {dict(k)["phase"] for n, k in series if n == "stalwart_train_phase_seconds_total"}
        assert {"data", "forward", "backward", "optimizer"} <= phases, phases
        assert all({**dict(k), **run_labels} == dict(k) for _, k in series)  # the run directory labels everything
    tokens = [v for (n, _), v in got[0].items() if n == "stalwart_train_tokens_total"]
    assert tokens and tokens[0] > 0 and tokens[0] % 128 == 0  # 4 sequences of 32 tokens per step
    assert not any(n == "stalwart_train_loss" for n, _ in got[1])  # run-level series come from rank 0 only

    assert "profile: wrote" in stdout
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"rank-{rank}-steps-3-4.trace.json").read_text())
        events = trace["traceEvents"]
        assert sorted(e["name"] for e in events if e.get("name", "").startswith("stalwart.step")) == \
            ["stalwart.step 3", "stalwart.step 4"]
        ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
        assert {"aten::mm", "aten::embedding"} <= ops, sorted(ops)[:20]
        assert trace["distributedInfo"]["rank"] == rank
    out = run_cli("report", str(run), "--no-plots")
    html = (run / "report" / "report.html").read_text()
    assert "../profile/rank-1-steps-3-4.trace.json" in html
    assert "rank-0-steps-3-4.trace.json" in out.stdout
