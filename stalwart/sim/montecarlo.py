"""From a config to a job model, and from many seeded replications to estimates with intervals."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from stalwart.sim import daly
from stalwart.sim.causes import CATALOG
from stalwart.sim.config import SimConfig, spare_hosts
from stalwart.sim.engine import BUCKETS, JobModel, RepResult, mean_downtime_s, simulate_once
from stalwart.sim.recovery import group_costs, replica_groups, restart_seconds

Z95 = 1.959964
RECOVERY_MODELS = ("whole_job", "per_group")


def build_job_model(cfg: SimConfig, interval_s: float | None = None, recovery: str | None = None) -> JobModel:
    """Translate the config into seconds and whole-job rates; ``interval_s`` overrides the config's
    interval and ``recovery`` its recovery model."""
    hosts = cfg.job.gpus / cfg.job.gpus_per_host
    rates, detects, hw, wide = [], [], [], []
    for c in CATALOG:
        sec = getattr(cfg.failures, c.name)
        units = cfg.job.gpus if sec.per == "gpu" else hosts
        rates.append(sec.rate * 1e-6 * units / 3600.0)
        detects.append(sec.detect_min * 60.0 * cfg.recovery.detection_scale)
        hw.append(sec.hardware)
        wide.append(sec.reach == "job")
    ck = cfg.checkpoint
    stall = ck.save_s if ck.mode == "sync" else ck.snapshot_s
    persist = 0.0 if ck.mode == "sync" else ck.save_s
    model = JobModel(
        horizon_s=cfg.job.days * 86400.0, cause_names=tuple(c.name for c in CATALOG),
        cause_rate_s=np.asarray(rates), detect_s=np.asarray(detects), hardware=np.asarray(hw, dtype=bool),
        interval_s=1.0, stall_s=stall, persist_s=persist, final_save_s=ck.save_s if ck.mode == "sync" else stall,
        restart_s=restart_seconds(cfg), swap_s=cfg.recovery.swap_s, spare_hosts=spare_hosts(cfg),
        repair_mean_s=cfg.spares.repair_h * 3600.0,
        maint_interval_s=cfg.maintenance.interval_h * 3600.0, maint_downtime_s=cfg.maintenance.downtime_min * 60.0,
        groups=replica_groups(cfg) if (recovery or cfg.recovery.model) == "per_group" else 1,
        job_wide=np.asarray(wide, dtype=bool), **group_costs(cfg))
    if interval_s is None:
        interval_s = ck.interval_min * 60.0 if ck.interval_min > 0 else young_daly(model)["daly_s"]
    return dataclasses.replace(model, interval_s=max(interval_s, 1.0))


def young_daly(m: JobModel) -> dict[str, float]:
    """Analytic optimum; an async checkpoint cannot start before the previous one is durable. Only
    whole-job rollbacks lose work, so under per-group recovery M is the time between those."""
    rollback = float(m.rollback_rate_s.sum())
    mtbf = 1.0 / rollback if rollback > 0 else m.horizon_s
    delta = max(m.stall_s, 1e-9)
    down = mean_downtime_s(m)
    y = daly.young_interval(delta, mtbf)
    d = max(daly.daly_interval(delta, mtbf, down), m.persist_s, 1.0)
    waste = daly.expected_waste_fraction(d, m.stall_s, mtbf, down, m.persist_s) + group_waste_fraction(m)
    return {"mtbf_s": mtbf, "delta_s": m.stall_s, "young_s": y, "daly_s": d, "predicted_ettr": 1.0 - waste}


def group_waste_fraction(m: JobModel) -> float:
    """First order, the share of wall time group-local faults cost: the survivors' stalls (detection,
    two regroups, the transfer) and the lost group's share while it is away (spares available)."""
    if m.groups == 1:
        return 0.0
    local = m.cause_rate_s * ~m.job_wide
    stall = m.detect_s + 2 * m.regroup_s + m.transfer_s
    away = m.hardware * m.swap_s + m.group_restart_s
    return float((local * (stall + away / m.groups)).sum())


@dataclass
class Estimate:
    mean: float
    lo: float            # 95% confidence interval of the mean
    hi: float
    p5: float            # spread of single replications
    p95: float

    @classmethod
    def of(cls, xs: np.ndarray) -> Estimate:
        xs = np.asarray(xs, dtype=float)
        mean = float(xs.mean())
        half = Z95 * float(xs.std(ddof=1)) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
        return cls(mean, mean - half, mean + half, float(np.percentile(xs, 5)), float(np.percentile(xs, 95)))

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "ci95": [self.lo, self.hi], "p5": self.p5, "p95": self.p95}


@dataclass
class Summary:
    model: JobModel
    replications: int
    ettr: Estimate
    buckets_s: dict[str, Estimate]          # mean wall seconds per bucket
    causes: dict[str, Estimate]             # unplanned interruptions per cause
    unplanned: Estimate
    planned: Estimate
    checkpoints: float
    first: RepResult                        # replication 0 with its timeline (power, plots)
    ettr_runs: np.ndarray                   # (replications,) ETTR of each run
    group_recoveries: float = 0.0           # mean faults per run that stopped one replica group only

    def to_dict(self) -> dict:
        return {
            "replications": self.replications, "interval_s": self.model.interval_s,
            "ettr": self.ettr.to_dict(),
            "wall_time_s": {k: v.to_dict() for k, v in self.buckets_s.items()},
            "interruptions": {"unplanned": self.unplanned.to_dict(), "planned": self.planned.to_dict(),
                              "by_cause": {k: v.to_dict() for k, v in self.causes.items()}},
            "checkpoints_per_replication": self.checkpoints,
            "recovery": {"model": "per_group" if self.model.groups > 1 else "whole_job", "groups": self.model.groups,
                         "group_recoveries": self.group_recoveries,
                         "whole_job_restarts": self.unplanned.mean + self.planned.mean - self.group_recoveries},
        }


def seeds(base: int, n: int) -> list[np.random.Generator]:
    return [np.random.default_rng(s) for s in np.random.SeedSequence(base).spawn(n)]


def run(model: JobModel, replications: int, seed: int) -> Summary:
    """``replications`` independent runs; equal seeds give equal results (common random numbers)."""
    results = [simulate_once(model, rng, keep_timeline=(i == 0)) for i, rng in enumerate(seeds(seed, replications))]
    secs = np.stack([r.seconds for r in results])            # (reps, buckets)
    counts = np.stack([r.cause_counts for r in results])     # (reps, causes)
    ettrs = np.array([r.ettr for r in results])
    return Summary(
        model=model, replications=replications, ettr=Estimate.of(ettrs), ettr_runs=ettrs,
        buckets_s={b: Estimate.of(secs[:, i]) for i, b in enumerate(BUCKETS)},
        causes={c: Estimate.of(counts[:, i]) for i, c in enumerate(model.cause_names)},
        unplanned=Estimate.of(counts.sum(axis=1)), planned=Estimate.of(np.array([r.planned for r in results])),
        checkpoints=float(np.mean([r.checkpoints for r in results])), first=results[0],
        group_recoveries=float(np.mean([r.group_recoveries for r in results])))


def compare_recovery(cfg: SimConfig, done: Summary | None = None) -> dict[str, Summary]:
    """Both recovery models on the same seeds (so the same failure traces), each at its own interval
    unless the config fixes one; ``done`` is a summary already run for ``cfg.recovery.model``."""
    out = {}
    for name in RECOVERY_MODELS:
        if done is not None and name == cfg.recovery.model:
            out[name] = done
        else:
            out[name] = run(build_job_model(cfg, recovery=name), cfg.run.replications, cfg.run.seed)
    return out


def optimal_interval(model: JobModel, replications: int, seed: int,
                     factors: tuple[float, ...] = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)
                     ) -> tuple[float, list[tuple[float, Estimate]]]:
    """Grid search around Young/Daly with common random numbers; returns (best interval, the curve)."""
    base = young_daly(model)["daly_s"]
    curve = []
    for f in factors:
        interval = max(base * f, model.persist_s, 1.0)
        if curve and abs(curve[-1][0] - interval) < 1e-9:
            continue
        curve.append((interval, run(dataclasses.replace(model, interval_s=interval), replications, seed).ettr))
    best = max(curve, key=lambda p: p[1].mean)[0]
    return best, curve
