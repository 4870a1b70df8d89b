"""`stalwart bench throughput` end to end: the reference workload's figures, the layout the training core
chose, for replicas DDP's measured all-reduce time, with what of it backward waited for, and the per-op
profile."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

pytestmark = pytest.mark.e2e


def test_bench_throughput_reports_the_layout_and_the_exposed_all_reduce(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "throughput", "--procs", "1,2", "--steps", "2", "--warmup", "1", "--micro-batch", "1",
                   "--threads", "1", "--json", str(out), "--profile", "1")
    one, two = json.loads(out.read_text())
    assert one["layout"] == "one process" and "exposed_ms" not in one
    assert two["layout"] == "replicated (DDP)" and two["world"] == 2 and two["tokens_per_s"] > 0
    # DDP timed the all-reduce: a span that includes what ran beside backward's compute and what did not.
    assert two["all_reduce_ms"] > 0 and 0 <= two["exposed_ms"] <= two["all_reduce_ms"]
    assert abs(two["all_reduce_ms"] - two["overlapped_ms"] - two["exposed_ms"]) < 1e-6
    assert "replicated (DDP) (" in proc.stdout and "exposed)" in proc.stdout
    # The per-op profile, for two processes too (every rank steps; rank 0 records).
    assert proc.stdout.count("ms of op self time per step") == 2 and "aten::mm" in proc.stdout
