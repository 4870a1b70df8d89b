"""A realistic synthetic run directory (metrics, events, per-rank timings, config, summary).

For tests, demos and the docs: ``write_synthetic_run(path, ranks=4, slow_rank=2)`` writes what a
supervised 4-rank job with one slow rank would leave behind, including (``failure_at``) one killed
worker: the supervisor's ``failure`` (``FAILURE`` below), ``restart`` and ``recovered`` events and the
trainer's ``resumed`` from the newest checkpoint, the steps after it trained twice.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from stalwart.paths import RunPaths

# The supervisor's timeline around the injected failure (seconds).
FAILURE = {"into_step_s": 0.05, "detection_s": 1.5, "stop_s": 4.5, "rendezvous_s": 2.0, "resume_s": 1.0}
STARTUP_S = 2.0  # launch -> the trainer's start event


def write_synthetic_run(run_dir: str | Path, ranks: int = 4, steps: int = 60, slow_rank: int | None = 2,
                        slow_factor: float = 1.5, failure_at: int | None = 35, ckpt_every: int = 20,
                        seed: int = 0, t0: float = 1.8e9) -> Path:
    rng = random.Random(seed)
    paths = RunPaths(run_dir)
    paths.timings_dir.mkdir(parents=True, exist_ok=True)
    paths.config.write_text('[run]\nname = "synthetic"\n\n[training]\nsteps = %d\n' % steps)
    metrics, events, timings = [], [], {r: [] for r in range(ranks)}
    t = t0
    events.append({"time": t, "event": "launch", "max_restarts": 3, "ranks": list(range(ranks)), "progress_step": 0})
    t += STARTUP_S
    events.append({"time": t, "event": "start", "step": 0, "world_size": ranks, "layout": f"fsdp {ranks}"})
    metrics.append({"step": 0, "eval_loss": 8.0, "time": t + 0.5})
    t += 1.0
    step, resumed, failure = 1, False, None
    while step <= steps:
        if failure_at and step == failure_at and not resumed:
            ckpt = (step - 1) // ckpt_every * ckpt_every if ckpt_every else 0
            fault = t + FAILURE["into_step_s"]
            t = fault + FAILURE["detection_s"]
            failure = {"kind": "signal", "rank": 1, "host": 1, "step": step - 1, "exitcode": -9, "attempt": 0,
                       "fault_time": fault, "detect_time": t, "detection_latency_s": FAILURE["detection_s"],
                       "injected": "kill", "progress_step": ckpt, "decision": "restart"}
            events.append({"time": t, "event": "failure", **failure})
            t += FAILURE["stop_s"]
            events.append({"time": t, "event": "restart", "attempt": 1, "remaining_restarts": 2,
                           "progress_step": ckpt, "restart_s": FAILURE["stop_s"]})
            t += FAILURE["rendezvous_s"]
            events.append({"time": t, "event": "resumed", "step": ckpt, "path": f"checkpoints/step-{ckpt}",
                           "source": "disk"})
            events.append({"time": t + 0.5, "event": "start", "step": ckpt, "world_size": ranks})
            t += FAILURE["resume_s"]
            step, resumed = ckpt + 1, True
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
        if failure is not None:  # the first step after the restart completed on every rank
            events.append({"time": t, "event": "recovered", "attempt": 1, "failure_kind": failure["kind"],
                           "failure_step": failure["step"], "resumed_step": step - 1,
                           "steps_recomputed": failure["step"] - (step - 1),
                           "recovery_s": round(t - failure["detect_time"], 3),
                           "fault_to_step_s": round(t - failure["fault_time"], 3)})
            failure = None
        if ckpt_every and step % ckpt_every == 0:
            metrics.append({"step": step, "eval_loss": loss + 0.1, "time": t + 0.2})
            events.append({"time": t + 0.2, "event": "eval", "step": step, "eval_loss": loss + 0.1})
            events.append({"time": t + 1.0, "event": "checkpoint_saved", "step": step,
                           "path": f"checkpoints/step-{step}", "seconds": 0.8})
            t += 1.0
        step += 1
    final_loss = [m for m in metrics if "loss" in m][-1]["loss"]
    events.append({"time": t, "event": "finished", "step": steps, "final_loss": final_loss})
    n_failures = int(bool(failure_at and failure_at <= steps))
    events.append({"time": t + 0.5, "event": "supervisor_exit", "code": 0, "verdict": "finished",
                   "restarts": n_failures, "failures": n_failures})
    for path, rows in ((paths.metrics, metrics), (paths.events, events)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r, rows in timings.items():
        paths.timings(r).write_text("".join(json.dumps(x) + "\n" for x in rows))
    paths.summary.write_text(json.dumps({"steps": steps, "final_loss": final_loss,
                                         "tokens_per_s": 4096 * ranks / 0.15, "mfu": 0.22, "world_size": ranks}))
    return paths.root


def write_long_run(run_dir: str | Path, steps: int = 1_000_000, t0: float = 1.8e9) -> Path:
    """A run with ``steps`` logged training steps (metrics.jsonl and a few events; no timings): what a
    long pre-training run leaves behind, for the dashboard's downsampling. One eval every 10k steps."""
    paths = RunPaths(run_dir)
    paths.root.mkdir(parents=True, exist_ok=True)
    line = '{"step": %d, "loss": %.5f, "lr": %.4e, "grad_norm": %.4f, "tokens_per_s": %.1f, "time": %.2f}\n'
    with open(paths.metrics, "w") as f:
        for lo in range(1, steps + 1, 100_000):
            f.write("".join(line % (s, 2.0 + 6.0 * math.exp(-s / 50_000) + 0.05 * math.sin(s * 0.7),
                                    3e-4 * min(1.0, s / 2000), 1.0 + 0.3 * math.sin(s * 1.3), 5e5 + 1e4 * math.sin(s),
                                    t0 + 0.5 * s)
                            for s in range(lo, min(lo + 100_000, steps + 1))))
            f.write("".join('{"step": %d, "eval_loss": %.5f, "time": %.2f}\n'
                            % (s, 2.1 + 6.0 * math.exp(-s / 50_000), t0 + 0.5 * s)
                            for s in range(lo - 1 + 10_000, min(lo + 100_000, steps + 1), 10_000)))
    events = [{"time": t0, "event": "start", "step": 0, "world_size": 8},
              {"time": t0 + 0.5 * steps / 2, "event": "restart", "step": steps // 2, "attempt": 1},
              {"time": t0 + 0.5 * steps, "event": "finished", "step": steps}]
    paths.events.write_text("".join(json.dumps(e) + "\n" for e in events))
    return paths.root
