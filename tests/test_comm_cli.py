"""`stalwart bench collectives` end to end through the real CLI: measures, fits, writes a topology."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from stalwart.comm.topology import load_topology

pytestmark = pytest.mark.e2e


def test_bench_collectives_cli(tmp_path: Path) -> None:
    topo_file, out = tmp_path / "fitted.toml", tmp_path / "bench.json"
    proc = run_cli("bench", "collectives", "--world", "3", "--min_bytes", "1024", "--max_bytes", "65536",
                   "--algorithms", "ring,rd,rhd,builtin", "--ops", "all_reduce,all_gather", "--iters", "3",
                   "--budget_s", "0.05", "--write_topology", str(topo_file), "--json_out", str(out), timeout=240)
    assert "bus bandwidth" in proc.stdout and "fit_held_out" in proc.stdout
    topo = load_topology(topo_file)  # a valid topology the trainer can load
    assert topo.ranks_per_host == 3 and topo.name.startswith("fitted")
    result = json.loads(out.read_text())
    measured = {(r["op"], r["algorithm"], r["bytes"]) for r in result["rows"]}
    assert len(measured) == 4 * (4 + 2)  # 4 sizes x (4 all-reduce + ring, builtin all-gather)
    assert all(r["seconds"] > 0 for r in result["rows"])
    assert 0 < result["summary"]["fit_in_sample"]["median_rel_err"] < 10


def test_bench_collectives_rejects_bad_options() -> None:
    proc = run_cli("bench", "collectives", "--wrld", "3", check=False)
    assert proc.returncode == 2 and "did you mean '--world'" in proc.stderr.replace("'world'", "'--world'")
    proc = run_cli("bench", "collectives", "--ops", "all_to_all", check=False)
    assert proc.returncode == 2 and "unknown collective" in proc.stderr
    help_out = run_cli("bench", "collectives", "--help").stdout
    assert "--netns.rate_mbit" in help_out
