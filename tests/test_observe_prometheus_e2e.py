"""A live two-rank training run scraped over HTTP: every rank serves its own Prometheus endpoint."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY_RUN, cli_env
from stalwart.comm.launch import free_port
from test_observe_sinks import scrape

pytestmark = pytest.mark.e2e


def test_two_ranks_export_per_rank_series_while_training(tmp_path):
    port = free_port()
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart", "train", "--run.dir", str(run), *TINY_RUN, "--nproc-per-node", "2",
         "--training.steps", "5000", "--checkpoint.interval", "0", "--checkpoint.at_end", "false",
         "--observe.prometheus_port", str(port), "--observe.timings_flush_every", "2"],
        env=cli_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline, got = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                got = [scrape(port), scrape(port + 1)]
            except OSError:
                got = None
            if got and all(any(n == "stalwart_train_phase_seconds_total" for n, _ in g) for g in got):
                break
            time.sleep(0.5)
        assert got is not None, proc.stdout.read() if proc.poll() is not None else "no endpoint in 120 s"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    run_labels = {"run": "run", "run_dir": str(run.resolve())}
    for rank, series in enumerate(got):
        assert {dict(k)["rank"] for n, k in series if n == "stalwart_train_step_duration_seconds"} == {str(rank)}
        phases = {dict(k)["phase"] for n, k in series if n == "stalwart_train_phase_seconds_total"}
        assert {"data", "forward", "backward", "optimizer"} <= phases, phases
        assert all({**dict(k), **run_labels} == dict(k) for _, k in series)  # the run directory labels everything
    tokens = [v for (n, _), v in got[0].items() if n == "stalwart_train_tokens_total"]
    assert tokens and tokens[0] > 0 and tokens[0] % 128 == 0  # 4 sequences of 32 tokens per step
    assert not any(n == "stalwart_train_loss" for n, _ in got[1])
