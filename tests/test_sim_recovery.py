"""Per-replica-group recovery next to whole-job restarts: same traces, fallbacks, R = 1, calibration."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from stalwart.config import ConfigError, load
from stalwart.sim.causes import CATALOG, LLAMA3_PLANNED, LLAMA3_TOTAL
from stalwart.sim.config import SimConfig
from stalwart.sim.engine import DEGRADED, LOST, REGROUP, SPARE_WAIT, simulate_once
from stalwart.sim.montecarlo import build_job_model, compare_recovery, run, young_daly
from stalwart.sim.recovery import assumptions, group_costs, replica_groups, restart_seconds

pytestmark = pytest.mark.unit

PRESET = Path(__file__).resolve().parents[1] / "configs" / "sim" / "llama3_405b.toml"
JOB_WIDE = {"software_bug", "network", "nccl_watchdog", "sdc", "dependency"}


def config(*args: str) -> SimConfig:
    return load(SimConfig, PRESET, list(args))


def only(m, names: set[str]):
    """The model with every cause but ``names`` switched off."""
    keep = np.array([n in names for n in m.cause_names])
    return dataclasses.replace(m, cause_rate_s=m.cause_rate_s * keep)


def same_trace(a, b, seed: int):
    """One replication of each model from the same stream: the same failure trace."""
    return simulate_once(a, np.random.default_rng(seed)), simulate_once(b, np.random.default_rng(seed))


def test_per_group_ettr_is_at_least_whole_job_on_the_same_trace():
    for gpus in ("16384", "131072"):
        cfg = config("--job.gpus", gpus, "--job.days", "7")
        whole, group = (build_job_model(cfg, recovery=r) for r in ("whole_job", "per_group"))
        common = dataclasses.replace(group, interval_s=whole.interval_s)      # the same checkpoints too
        for seed in range(6):
            w, g = same_trace(whole, group, seed)
            _, c = same_trace(whole, common, seed)
            assert np.array_equal(w.cause_counts, g.cause_counts) and w.planned == g.planned
            assert g.ettr >= w.ettr and c.ettr >= w.ettr, (gpus, seed)
            assert g.group_recoveries > 0 and g.seconds[LOST] < w.seconds[LOST]
            assert g.seconds[DEGRADED] > 0 and g.seconds[REGROUP] > 0           # not free: stalls and less throughput


def test_a_job_wide_cause_falls_back_to_the_whole_job_restart():
    assert {c.name for c in CATALOG if c.reach == "job"} == JOB_WIDE
    cfg = config("--job.days", "10")
    whole, group = (only(build_job_model(cfg, 600.0, recovery=r), JOB_WIDE) for r in ("whole_job", "per_group"))
    assert group.groups == 128
    for seed in range(4):
        w, g = same_trace(whole, group, seed)
        assert g.cause_counts.sum() > 0 and g.group_recoveries == 0
        assert np.array_equal(w.seconds, g.seconds)                             # exactly today's restart


def test_group_local_faults_roll_nothing_back_and_survivors_do_not_wait_for_spares():
    local = {c.name for c in CATALOG} - JOB_WIDE
    cfg = config("--job.days", "10", "--spares.hosts", "0", "--maintenance.interval_h", "0")
    whole, group = (only(build_job_model(cfg, 600.0, recovery=r), local) for r in ("whole_job", "per_group"))
    w, g = same_trace(whole, group, 1)
    assert g.group_recoveries == g.cause_counts.sum() > 0
    assert g.seconds[LOST] == 0 and g.seconds[SPARE_WAIT] == 0 < w.seconds[SPARE_WAIT]
    # No spares: the whole job waits for every repair; a group waits alone while the others train.
    assert g.ettr > 0.8 > 0.1 > w.ettr and g.seconds[DEGRADED] / g.seconds.sum() > 0.03


def test_with_one_group_the_two_models_agree():
    cfg = config("--job.gpus", "1024", "--groups.gpus", "1024", "--job.days", "20", "--spares.hosts", "1")
    assert replica_groups(cfg) == 1
    whole, group = (build_job_model(cfg, recovery=r) for r in ("whole_job", "per_group"))
    assert group.groups == 1 and group.interval_s == whole.interval_s
    everything_local = dataclasses.replace(group, job_wide=np.zeros_like(group.job_wide))
    for seed in range(5):
        w, g = same_trace(whole, everything_local, seed)
        assert np.array_equal(w.seconds, g.seconds) and g.group_recoveries == 0
    small = config("--job.gpus", "64")                                          # smaller than a group: one group
    assert replica_groups(small) == 1


def test_calibration_is_unchanged_under_per_group_recovery():
    cfg = config("--recovery.model", "per_group")
    s = run(build_job_model(cfg), 100, 0)
    assert abs(s.unplanned.mean - (LLAMA3_TOTAL - LLAMA3_PLANNED)) < 4 * math.sqrt(419 / 100)
    assert s.planned.mean == LLAMA3_PLANNED
    for c in CATALOG:
        assert abs(s.causes[c.name].mean - c.llama3_count) < 4 * math.sqrt(max(c.llama3_count, 1) / 100) + 0.05
    both = compare_recovery(config("--run.replications", "20"))
    assert np.array_equal(both["whole_job"].causes["faulty_gpu"].mean, both["per_group"].causes["faulty_gpu"].mean)
    assert both["per_group"].ettr.mean > both["whole_job"].ettr.mean > 0.90


def test_recovery_costs_and_assumptions():
    small, big = config(), config("--job.gpus", "131072")
    assert replica_groups(small) == 128 and replica_groups(big) == 1024
    a, b = group_costs(small), group_costs(big)
    assert a["group_restart_s"] == b["group_restart_s"] == pytest.approx(60 + 20 * math.sqrt(0.128))
    assert restart_seconds(big) > restart_seconds(small) > a["group_restart_s"]  # the whole job's grows with size
    assert a["transfer_s"] == pytest.approx(5670 / (128 * 50))
    assert b["regroup_s"] > a["regroup_s"]                                     # more groups to regroup
    text = " ".join(assumptions(small)["lines"])
    assert "Silent data corruption" in text and "R = 128" in text
    # Only whole-job rollbacks lose work, so the per-group checkpoint interval is longer.
    assert young_daly(build_job_model(small, recovery="per_group"))["daly_s"] > \
        young_daly(build_job_model(small, recovery="whole_job"))["daly_s"]


def test_group_size_is_whole_hosts_and_a_remainder_is_spread():
    with pytest.raises(ConfigError, match="groups.gpus"):
        config("--groups.gpus", "12")
    # 1,280 GPUs in groups of 512: 2 groups of 640 (whole-job sizes that are not a multiple still simulate)
    assert replica_groups(config("--job.gpus", "1280", "--groups.gpus", "512")) == 2
