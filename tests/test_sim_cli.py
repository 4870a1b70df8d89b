"""`stalwart simulate` end to end through the real CLI."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

from stalwart.config import undocumented_fields
from stalwart.sim.config import SimConfig

pytestmark = pytest.mark.e2e


def test_simulate_quick_with_json_plot_and_sweep(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    proc = run_cli("simulate", "--config", "quick", "--json", str(out), "--plot", str(png),
                   "--sweep", "job.gpus=512,2048", "--run.replications", "10", timeout=120)
    assert "ETTR" in proc.stdout and "sweep" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["replications"] == 10 and 0 < doc["ettr"]["mean"] < 1
    lo, hi = doc["ettr"]["ci95"]
    assert lo <= doc["ettr"]["mean"] <= hi
    assert set(doc["wall_time_s"]) >= {"productive", "lost", "detection", "restart", "checkpoint"}
    assert [p["overrides"][0][1] for p in doc["sweep"]] == ["512", "2048"]
    assert doc["sweep"][0]["unplanned"] < doc["sweep"][1]["unplanned"]      # bigger job, more faults
    assert doc["power"]["swing_mw"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    # Both recovery models side by side on the same traces, with the assumptions printed and in the JSON.
    rm = doc["recovery_models"]
    assert rm["per_group"]["groups"] == rm["assumptions"]["groups"] == 8 and rm["whole_job"]["groups"] == 1
    assert rm["per_group"]["ettr"]["mean"] >= rm["whole_job"]["ettr"]["mean"]
    assert "sdc" in rm["assumptions"]["job_wide_causes"] and "faulty_gpu" in rm["assumptions"]["group_local_causes"]
    assert "per replica group" in proc.stdout and "job-wide causes" in proc.stdout
    assert [p["recovery_models"]["per_group"]["groups"] for p in doc["sweep"]] == [4, 16]


def test_simulate_cluster_preset_and_whatifs(tmp_path):
    out = tmp_path / "c.json"
    run_cli("simulate", "--config", "cluster", "--whatifs", "--run.replications", "5", "--json", str(out),
            timeout=120)
    doc = json.loads(out.read_text())
    assert doc["cluster"]["completed"] == doc["cluster"]["jobs"]
    assert len(doc["whatifs"]) >= 5
    assert doc["whatifs"][0]["ettr"]["mean"] >= doc["whatifs"][-1]["ettr"]["mean"]


def test_simulate_help_documents_every_field():
    assert undocumented_fields(SimConfig) == []
    text = run_cli("simulate", "--help").stdout
    for key in ("job.gpus", "checkpoint.interval_min", "failures.hbm3.rate", "failures.sdc.detect_min",
                "spares.repair_h", "power.ramp_s", "cluster.placement", "recovery.model", "groups.gpus",
                "failures.sdc.reach", "--sweep", "--json", "--plot"):
        assert key in text, key


def test_simulate_bad_input_is_one_line_and_nonzero(tmp_path):
    for args in (["--job.gpuz", "8"], ["--job.gpus", "many"], ["--job.gpus", str(10**11)],
                 ["--config", "missing-preset"],
                 ["--sweep", "job.gpus"], ["--checkpoint.mode", "lazy"], ["--checkpoint.interval_min", "nan"],
                 ["--recovery.model", "partial"], ["--groups.gpus", "12"],
                 ["--plot", str(tmp_path)], ["--json", "/proc/stalwart-sim.json"]):
        proc = run_cli("simulate", *args, check=False)
        assert proc.returncode == 2, args
        assert len(proc.stderr.strip().splitlines()) == 1 and "error" in proc.stderr, proc.stderr
