"""`stalwart plan` end to end through the real CLI."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

from stalwart.config import undocumented_fields
from stalwart.planner.config import PlanConfig

pytestmark = pytest.mark.e2e


def test_plan_small_config_ranks_and_explains(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_cli("plan", "--model.flavor", "llama3-1B", "--cluster.gpus", "16", "--workload.seq_len", "4096",
                   "--workload.global_batch", "64", "--search.top", "3", "--json", str(out))
    assert "best layout" in proc.stdout and "MFU" in proc.stdout
    doc = json.loads(out.read_text())
    assert len(doc["layouts"]) == 3 and all(x["fits"] for x in doc["layouts"])
    tps = [x["time"]["tokens_per_s_per_gpu"] for x in doc["layouts"]]
    assert tps == sorted(tps, reverse=True)
    top = doc["layouts"][0]
    lay = top["layout"]
    assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == 16
    assert top["memory_bytes"]["total"] <= 76e9


def test_plan_validate_passes(tmp_path):
    out = tmp_path / "v.json"
    proc = run_cli("plan", "--validate", "--json", str(out))
    rows = json.loads(out.read_text())["validation"]
    assert len(rows) >= 14 and all(r["ok"] for r in rows) and proc.returncode == 0, proc.stdout
    assert {r["role"] for r in rows} == {"fit", "held_out"} and "held-out rows max" in proc.stdout


def test_plan_help_documents_every_field():
    assert undocumented_fields(PlanConfig) == []
    text = run_cli("plan", "--help").stdout
    for key in ("model.flavor", "workload.global_batch_tokens", "cluster.gpu", "cluster.pod_gpus",
                "search.ac", "search.virtual_stages", "--validate", "--json"):
        assert key in text, key


def test_plan_bad_input_is_one_line_and_nonzero(tmp_path):
    (tmp_path / "file").write_text("")
    for args in (["--model.flavor", "llama3-7B"], ["--cluster.gpus", "zero"], ["--config", "/nope.toml"],
                 ["--search.tpp", "1"], ["--workload.global_batch_tokens", "100"], ["--cluster.nic_gbps", "nan"],
                 ["--json", str(tmp_path / "file" / "x.json")], ["--json", "/proc/stalwart-plan.json"]):
        proc = run_cli("plan", *args, check=False)
        assert proc.returncode == 2, args
        assert len(proc.stderr.strip().splitlines()) == 1 and "error" in proc.stderr, proc.stderr
        if args[0] == "--json":  # refused before the work, naming the flag
            assert "--json: cannot" in proc.stderr and not proc.stdout, proc.stderr


def test_readme_plan_line_scales_the_default_batch_with_the_cluster():
    proc = run_cli("plan", "--model.flavor", "llama3-405B", "--cluster.gpus", "8192", "--search.top", "1")
    assert "2048 sequences/step" in proc.stdout and "best layout" in proc.stdout
    bad = run_cli("plan", "--model.flavor", "llama3-405B", "--cluster.gpus", "8192", "--workload.global_batch", "3",
                  check=False)
    assert bad.returncode == 2 and "raise --workload.global_batch" in bad.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`stalwart plan | head -1`: the pipe closes under the writer; no traceback, the status a shell expects."""
    import subprocess
    import sys

    from conftest import REPO, cli_env

    proc = subprocess.Popen([sys.executable, "-m", "stalwart", "plan", "--cluster.gpus", "64"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=cli_env(), cwd=REPO)
    proc.stdout.close()  # before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and not err.strip(), err


def test_plan_islands_compares_sync_diloco_streaming(tmp_path):
    out = tmp_path / "islands.json"
    proc = run_cli("plan", "--islands", "--islands.params", "131392", "--islands.step_s", "0.05",
                   "--islands.inner_steps", "[50, 100]", "--workload.seq_len", "64", "--workload.global_batch", "8",
                   "--json", str(out))
    rows = {r["label"]: r for r in json.loads(out.read_text())["islands"]}
    assert list(rows) == ["sync", "diloco H=50 none", "diloco H=100 none", "streaming H=100 P=4 tau=1 int4"]
    assert rows["sync"]["step_s"] > 5 * rows["streaming H=100 P=4 tau=1 int4"]["step_s"]
    assert "util" in proc.stdout and "B/token" in proc.stdout
    for args in (["--islands.link_mbit", "0"], ["--islands.inner_steps", "[50]"], ["--islands.overlap", "25"],
                 ["--islands.quantize", "int2"], ["--validate"]):
        bad = run_cli("plan", "--islands", *args, check=False)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, (args, bad.stderr)
