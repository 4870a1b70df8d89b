"""Fit the cost model's parameters to measured collective times (used by `stalwart bench collectives`).

The predicted time is linear in the parameters once each round's bottleneck flow is known, so the fit
alternates: compute every measurement's terms under the current parameters, solve a non-negative
least-squares problem for (alpha, beta per tier used, gamma, software overheads) weighted by 1/time
(relative error, so 1 KiB and 256 MiB points count alike), repeat. Intra-host latency is folded into
the software per-step overhead (on one machine they are the same thing and cannot be told apart).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics

import numpy as np

from stalwart.comm.cost import efficiency_key, predict, terms
from stalwart.comm.topology import HOST, TIERS, Topology


@dataclasses.dataclass
class Fit:
    topology: Topology
    stats: dict
    tiers_used: list[str]


def predict_row(row: dict, topo: Topology, world: int) -> float:
    return predict(row["op"], row["algorithm"], list(range(world)), row["bytes"], topo, topo.place(world))


def accuracy(rows: list[dict], topo: Topology, world: int) -> dict:
    """Pearson correlation of log(predicted) vs log(measured), median and max relative error."""
    pred = [predict_row(r, topo, world) for r in rows]
    meas = [r["seconds"] for r in rows]
    rel = [abs(p - m) / m for p, m in zip(pred, meas)]
    lp, lm = np.log(pred), np.log(meas)
    corr = float(np.corrcoef(lp, lm)[0, 1]) if len(rows) > 2 else math.nan
    return {"points": len(rows), "log_corr": round(corr, 4), "median_rel_err": round(statistics.median(rel), 4),
            "p90_rel_err": round(float(np.quantile(rel, 0.9)), 4)}


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by dropping negative coordinates until none is left (small problems)."""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            x[free] = sol
            break
        free = [f for f, v in zip(free, sol) if v >= 0] if (sol >= 0).any() else []
    return x


def fit(rows: list[dict], prior: Topology, world: int, rounds: int = 4) -> Fit:
    """Stage 1 fits the tiers, gamma and Python overheads to the custom algorithms; stage 2 fits a
    per-byte factor per algorithm against those, and the built-in's per-round overhead (it is C++)."""
    topo = copy.deepcopy(prior)
    members = list(range(world))
    custom = [r for r in rows if r["algorithm"] != "builtin"] or rows
    used: list[int] = []
    for _ in range(rounds):
        pl = topo.place(world)
        ts = [terms(r["op"], r["algorithm"], members, r["bytes"], topo, pl) for r in custom]
        used = sorted({t for x in ts for t in range(4) if x.alpha_count[t] or x.beta_bytes[t]})
        cols: list[tuple[str, int]] = [("alpha", t) for t in used if t != HOST] + [("beta", t) for t in used]
        cols += [("gamma", 0), ("step", 0), ("message", 0), ("call", 0)]

        def feature(x, kind: str, t: int) -> float:
            return {"alpha": lambda: x.alpha_count[t], "beta": lambda: x.beta_bytes[t], "gamma": lambda: x.gamma_bytes,
                    "step": lambda: x.steps, "message": lambda: x.messages, "call": lambda: x.calls}[kind]()

        a = np.array([[feature(x, k, t) for k, t in cols] for x in ts], dtype=np.float64)
        sol = _solve(a, np.array([r["seconds"] for r in custom]))
        for (kind, t), v in zip(cols, sol):
            tier = topo.tiers.at(t)
            if kind == "alpha":
                tier.latency_us = float(v * 1e6)
            elif kind == "beta":
                tier.bandwidth_gbps = float(1.0 / v / 1e9) if v > 0 else 1e6
            elif kind == "gamma":
                topo.gamma_ns_per_byte = float(v * 1e9)
            elif kind == "step":
                topo.overhead.step_us = float(v * 1e6)
            elif kind == "message":
                topo.overhead.message_us = float(v * 1e6)
            else:
                topo.overhead.call_us = float(v * 1e6)
        if HOST in used:
            topo.tiers.host.latency_us = 0.0
    # Stage 2: one byte-cost factor per algorithm (and the built-in's own per-round overhead).
    pl = topo.place(world)
    for key in sorted({efficiency_key(r["op"], r["algorithm"]) for r in rows}):
        mine = [r for r in rows if efficiency_key(r["op"], r["algorithm"]) == key]
        algo = mine[0]["algorithm"]
        feats = []
        for r in mine:
            x = terms(r["op"], algo, members, r["bytes"], topo, pl)
            byte_part = x.gamma_bytes * topo.gamma() + sum(x.beta_bytes[t] * topo.tiers.at(t).beta() for t in range(4))
            o = topo.overhead
            fixed = sum(x.alpha_count[t] * topo.tiers.at(t).alpha() for t in range(4)) + 1e-6 * (
                x.steps * o.step_us + x.messages * o.message_us + x.calls * o.call_us)
            feats.append((x.builtin_steps, byte_part, fixed))
        f = np.array(feats)
        meas = np.array([r["seconds"] for r in mine])
        if algo == "builtin":
            steps_s, scale = _solve(f[:, :2], meas, meas - f[:, 2])
            topo.overhead.builtin_step_us = float(steps_s * 1e6)
        else:
            (scale,) = _solve(f[:, 1:2], meas, meas - f[:, 2])
        # NOTE: bounded: a factor far from 1 means the schedule is wrong, not that it should be trusted.
        setattr(topo.efficiency, key, float(np.clip(scale, 0.2, 5.0)) if scale > 0 else 1.0)
    topo.name = f"fitted-{prior.name}"
    return Fit(topo, accuracy(rows, topo, world), [TIERS[t] for t in used])


def _solve(a: np.ndarray, meas: np.ndarray, target: np.ndarray | None = None) -> np.ndarray:
    """x >= 0 minimizing sum(((a x - target) / meas)^2): relative error (target defaults to meas)."""
    target = meas if target is None else target
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    return _nnls(a / scale / meas[:, None], target / meas) / scale
