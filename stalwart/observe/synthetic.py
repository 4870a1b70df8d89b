"""A realistic synthetic run directory (metrics, events, per-rank timings, config, summary).

For tests, demos and the docs: ``write_synthetic_run(path, ranks=4, slow_rank=2)`` writes what a
4-rank job with one slow rank, one failure and one restart would leave behind.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path


def write_synthetic_run(run_dir: str | Path, ranks: int = 4, steps: int = 60, slow_rank: int | None = 2,
                        slow_factor: float = 1.5, failure_at: int | None = 35, ckpt_every: int = 20,
                        seed: int = 0, t0: float = 1.8e9) -> Path:
    rng = random.Random(seed)
    run_dir = Path(run_dir)
    (run_dir / "timings").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text('[run]\nname = "synthetic"\n\n[training]\nsteps = %d\n' % steps)
    metrics, events, timings = [], [], {r: [] for r in range(ranks)}
    t = t0
    events.append({"time": t, "event": "start", "step": 0, "world_size": ranks, "layout": f"fsdp {ranks}"})
    metrics.append({"step": 0, "eval_loss": 8.0, "time": t + 0.5})
    t += 1.0
    step, resumed = 1, False
    while step <= steps:
        if failure_at and step == failure_at and not resumed:
            events.append({"time": t, "event": "failure", "rank": 1, "error": "worker exited with code -9"})
            t += 6.0
            events.append({"time": t, "event": "restart", "attempt": 1})
            t += 2.0
            events.append({"time": t, "event": "start", "step": 20, "world_size": ranks})
            events.append({"time": t + 0.5, "event": "resumed", "step": 20, "path": "checkpoints/step-20"})
            t += 1.0
            step, resumed = 21, True
            continue
        phases_by_rank = {}
        for r in range(ranks):
            f = slow_factor if r == slow_rank else 1.0
            ph = {"data": 0.004 * rng.uniform(0.8, 1.2), "forward": 0.030 * f * rng.uniform(0.95, 1.05),
                  "backward": 0.060 * f * rng.uniform(0.95, 1.05), "optimizer": 0.010 * rng.uniform(0.9, 1.1)}
            phases_by_rank[r] = ph
        compute = {r: sum(p.values()) for r, p in phases_by_rank.items()}
        slowest = max(compute.values())
        for r, ph in phases_by_rank.items():
            ph["comm"] = 0.008 + (slowest - compute[r])  # fast ranks wait for the slow one
            starts, c = {}, 0.0
            for k, v in ph.items():
                starts[k] = round(c, 6)
                c += v
            timings[r].append({"step": step, "rank": r, "t_start": t + rng.uniform(0, 2e-4),
                               "step_time_s": c, "phases": ph, "phase_starts": starts})
        st = slowest + 0.008
        t += st
        loss = 8.0 * math.exp(-step / 40) + 2.5 + rng.uniform(-0.05, 0.05)
        metrics.append({"step": step, "loss": loss, "lr": 3e-4 * min(1, step / 10), "grad_norm": rng.uniform(0.5, 2),
                        "tokens_per_s": 4096 * ranks / st, "mfu": 0.31 * 0.11 / st, "step_time_s": st,
                        "data_wait_s": 0.004, "mem_bytes": 2_000_000_000, "time": t})
        if step % ckpt_every == 0:
            metrics.append({"step": step, "eval_loss": loss + 0.1, "time": t + 0.2})
            events.append({"time": t + 0.2, "event": "eval", "step": step, "eval_loss": loss + 0.1})
            events.append({"time": t + 1.0, "event": "checkpoint_saved", "step": step,
                           "path": f"checkpoints/step-{step}", "seconds": 0.8})
            t += 1.0
        step += 1
    final_loss = [m for m in metrics if "loss" in m][-1]["loss"]
    events.append({"time": t, "event": "finished", "step": steps, "final_loss": final_loss})
    for name, rows in (("metrics.jsonl", metrics), ("events.jsonl", events)):
        (run_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r, rows in timings.items():
        (run_dir / "timings" / f"rank-{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    (run_dir / "summary.json").write_text(json.dumps({"steps": steps, "final_loss": final_loss,
                                                      "tokens_per_s": 4096 * ranks / 0.15, "mfu": 0.22,
                                                      "world_size": ranks}))
    return run_dir
