"""Cluster scheduling/placement and facility power swings."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.sim.cluster import place, simulate_cluster
from stalwart.sim.config import ClusterSection, PowerSection
from stalwart.sim.power import power_report, step_change_mw

pytestmark = pytest.mark.unit


def test_topology_placement_best_fits_and_spans_few_racks():
    free = np.array([16, 5, 9, 16])
    rng = np.random.default_rng(0)
    assert place(free, 8, "topology", rng) == {2: 8}               # the fullest rack that fits
    alloc = place(free, 30, "topology", rng)
    assert sum(alloc.values()) == 30 and len(alloc) == 2
    assert place(free, 47, "topology", rng) is None


def test_topology_beats_random_placement_on_rack_span():
    kw = {"gpus_per_host": 8, "host_fail_rate_s": 3e-8, "repair_mean_s": 48 * 3600, "restart_s": 300,
              "checkpoint_interval_s": 1800}
    c = ClusterSection(enabled=True, jobs=60, days=5)
    topo = simulate_cluster(c, rng=np.random.default_rng(0), **kw)
    rand = simulate_cluster(ClusterSection(enabled=True, jobs=60, days=5, placement="random"),
                            rng=np.random.default_rng(0), **kw)
    assert topo.completed == topo.jobs == 60
    assert topo.rack_excess < 1.5 < rand.rack_excess
    assert topo.goodput_utilisation > rand.goodput_utilisation    # scattered jobs run slower
    assert 0 < topo.utilisation <= 1 and topo.goodput_utilisation <= topo.utilisation + 1e-9


def test_power_swing_of_a_16k_gpu_job_and_ramping():
    r = power_report(PowerSection(), 16384, 8, 54, 8.6, 0.0, 5.0)
    assert 10 <= r.swing_mw <= 15                                   # the seed figure: 10-15 MW
    assert r.peak_step_mw == r.swing_mw                              # no ramp: a step
    ramped = power_report(PowerSection(ramp_s=30), 16384, 8, 54, 8.6, 0.0, 5.0)
    assert ramped.peak_step_mw == r.swing_mw / 30
    assert step_change_mw(12, 0.5, 1) == 12
