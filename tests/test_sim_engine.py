"""Unit tests of the event engine, failure sampling and Young/Daly (pure, no subprocess)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from stalwart.config import load
from stalwart.sim import daly
from stalwart.sim.config import SimConfig
from stalwart.sim.engine import BUCKETS, SPARE_WAIT, fault_segment, simulate_once
from stalwart.sim.montecarlo import build_job_model, optimal_interval, run, young_daly

pytestmark = pytest.mark.unit


def model(**overrides):
    args = [x for k, v in overrides.items() for x in (f"--{k}", str(v))]
    return build_job_model(load(SimConfig, None, args))


def test_no_failures_gives_checkpoint_overhead_only():
    m = model(**{"job.gpus": 64, "job.days": 1, "checkpoint.interval_min": 10, "checkpoint.mode": "sync",
                 "checkpoint.save_s": 60, "maintenance.interval_h": 0})
    m = dataclasses.replace(m, cause_rate_s=np.zeros_like(m.cause_rate_s))
    r = simulate_once(m, np.random.default_rng(0))
    assert r.cause_counts.sum() == 0 and r.planned == 0
    assert r.ettr == pytest.approx(600 / 660, abs=1e-3)          # interval / (interval + stall)
    assert r.checkpoints == (86400 // 660)


def testfault_segment_lost_work_sync_and_async():
    m = model(**{"checkpoint.interval_min": 10, "checkpoint.mode": "sync", "checkpoint.save_s": 60})
    kept, lost, stalled, n = fault_segment(2 * 660 + 100, m)          # 2 checkpoints, 100 s of new work
    assert (kept, lost, stalled, n) == (1200, 100, 120, 2)
    kept, lost, stalled, n = fault_segment(660 + 630, m)               # fault during the 2nd save: it is lost
    assert kept == 600 and lost == 600 and stalled == pytest.approx(60 + 30)
    a = model(**{"checkpoint.interval_min": 10, "checkpoint.mode": "async", "checkpoint.save_s": 120,
                 "checkpoint.snapshot_s": 5})
    kept, lost, _, n = fault_segment(605 + 50, a)                      # snapshot taken, not yet durable
    assert n == 1 and kept == 0 and lost == pytest.approx(650)
    kept, lost, _, _ = fault_segment(605 + 200, a)                     # durable after 120 s
    assert kept == 600 and lost == pytest.approx(200)


def test_buckets_partition_the_horizon_and_seeds_reproduce():
    m = model(**{"job.gpus": 16384, "job.days": 10, "spares.hosts": 2})
    a = simulate_once(m, np.random.default_rng(7))
    b = simulate_once(m, np.random.default_rng(7))
    c = simulate_once(m, np.random.default_rng(8))
    assert a.seconds.sum() == pytest.approx(m.horizon_s, rel=1e-9)
    assert (a.seconds >= 0).all() and len(a.seconds) == len(BUCKETS)
    assert np.array_equal(a.seconds, b.seconds) and not np.array_equal(a.seconds, c.seconds)
    assert a.seconds[SPARE_WAIT] > 0                              # 2 spares cannot cover 10 days of faults


def test_failure_counts_are_poisson_with_the_configured_rate():
    m = model(**{"job.gpus": 4096, "job.days": 20})
    s = run(m, 200, 3)
    expected = m.total_rate_s * m.horizon_s
    assert abs(s.unplanned.mean - expected) < 4 * math.sqrt(expected / 200)
    # Poisson: variance equals the mean (within sampling error).
    counts = np.array([simulate_once(m, np.random.default_rng(i)).cause_counts.sum() for i in range(200)])
    assert 0.7 < counts.var(ddof=1) / counts.mean() < 1.4


def test_more_spares_and_faster_detection_help():
    base = run(model(**{"job.gpus": 16384, "job.days": 10, "spares.hosts": 0}), 20, 0).ettr.mean
    spares = run(model(**{"job.gpus": 16384, "job.days": 10, "spares.hosts": 50}), 20, 0).ettr.mean
    fast = run(model(**{"job.gpus": 16384, "job.days": 10, "spares.hosts": 50,
                        "recovery.detection_scale": 0.1}), 20, 0).ettr.mean
    assert base < spares < fast


def test_young_daly_formulas():
    assert daly.young_interval(60, 3600 * 3) == pytest.approx(math.sqrt(2 * 60 * 10800))
    assert daly.daly_interval(60, 10800, 0) == pytest.approx(math.sqrt(2 * 60 * 10800) - 60)
    assert daly.daly_interval(100, 40) == 40                      # delta >= 2M: checkpoint every M


def test_simulated_optimum_is_near_young_daly_for_sync_checkpoints():
    m = model(**{"job.gpus": 16384, "job.days": 14, "checkpoint.mode": "sync", "checkpoint.save_s": 60})
    yd = young_daly(m)["daly_s"]
    best, curve = optimal_interval(m, 20, 0)
    assert yd / 2 <= best <= yd * 2
    ettrs = [e.mean for _, e in curve]
    assert max(ettrs) - min(ettrs) > 0.01                         # the interval matters
