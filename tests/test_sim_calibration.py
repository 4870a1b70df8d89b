"""The Llama 3 preset reproduces the published interruption count and cause mix, with ETTR > 90%."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from conftest import unapplied_file_values
from stalwart.config import load
from stalwart.sim.causes import CATALOG, LLAMA3_PLANNED, LLAMA3_TOTAL
from stalwart.sim.config import SimConfig
from stalwart.sim.montecarlo import build_job_model, run

pytestmark = pytest.mark.unit

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "sim"


def test_every_preset_parses():
    files = sorted(PRESETS.glob("*.toml"))
    assert {f.stem for f in files} >= {"llama3_405b", "quick", "cluster"}
    for f in files:
        assert unapplied_file_values(load(SimConfig, f), f) == [], f.name  # the file's values are the loaded ones


def test_llama3_preset_reproduces_the_published_interruptions():
    cfg = load(SimConfig, PRESETS / "llama3_405b.toml")
    assert cfg.job.gpus == 16384 and cfg.job.days == 54
    t0 = time.perf_counter()
    s = run(build_job_model(cfg), 100, 0)
    assert time.perf_counter() - t0 < 20                           # "well under a minute"
    # Each cause within 4 standard errors of the mean (Poisson: sd = sqrt(count)).
    for c in CATALOG:
        se = math.sqrt(max(c.llama3_count, 1) / 100)
        assert abs(s.causes[c.name].mean - c.llama3_count) < 4 * se + 0.05, c.name
    assert abs(s.unplanned.mean - (LLAMA3_TOTAL - LLAMA3_PLANNED)) < 4 * math.sqrt(419 / 100)
    assert s.planned.mean == LLAMA3_PLANNED
    assert s.ettr.lo > 0.90, s.ettr


def test_rates_scale_with_job_size():
    small = build_job_model(load(SimConfig, PRESETS / "llama3_405b.toml", ["--job.gpus", "1024"]))
    big = build_job_model(load(SimConfig, PRESETS / "llama3_405b.toml"))
    assert big.total_rate_s / small.total_rate_s == 16
    assert big.restart_s > small.restart_s                          # restart grows with size
