"""Goodput accounting from a run directory's events.jsonl and metrics.jsonl (pure; no torch).

Wall time (from the supervisor's ``launch`` to its ``supervisor_exit``, or the first to the last
record) is split into:

- productive   step time of steps whose result was kept
- lost         step time of steps recomputed after a failure, plus the partial step cut off by the fault
- detection    fault -> the supervisor noticing it (per failure: ``detection_latency_s``)
- restart      detection -> the first step of the next attempt starts (stop, rendezvous, rebuild, resume)
- checkpoint   the training loop's stall for checkpoint saves (``stall_s``; whole save when synchronous)
- startup      launch -> the first step of the first attempt starts
- other        the rest: evaluation, logging, the final evaluation/sample, shutdown

ETTR (effective training time ratio) = productive / wall. Needs ``metrics.log_interval = 1`` for an
exact split (a logged step stands for itself only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stalwart.metrics.records import read_jsonl

BUCKETS = ("productive", "lost", "detection", "restart", "checkpoint", "startup", "other")


def account(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    steps = sorted((m for m in metrics if "loss" in m and "step_time_s" in m and "time" in m),
                   key=lambda m: m["time"])
    times = [e["time"] for e in events if "time" in e] + [m["time"] for m in steps]
    if not times:
        return {"wall_s": 0.0, "buckets": {b: 0.0 for b in BUCKETS}, "ettr": 0.0, "failures": []}
    launch = next((e for e in events if e.get("event") == "launch"), None)
    t_begin = launch["time"] if launch else min(times)
    exit_ev = [e for e in events if e.get("event") == "supervisor_exit"]
    t_end = exit_ev[-1]["time"] if exit_ev else max(times)
    failures = [e for e in events if e.get("event") == "failure" and "detect_time" in e]
    recovered = {e["attempt"]: e for e in events if e.get("event") == "recovered"}

    # Attempt k runs from its start (launch, or the previous failure's detection) to its failure's detection.
    bounds = [t_begin] + [f["detect_time"] for f in failures] + [t_end]
    b = {k: 0.0 for k in BUCKETS}
    out_failures = []
    for k in range(len(bounds) - 1):
        start, end = bounds[k], bounds[k + 1]
        mine = [m for m in steps if start < m["time"] <= end]
        failure = failures[k] if k < len(failures) else None
        if failure is not None:
            nxt = [e for e in events if e.get("event") == "resumed" and end < e["time"] <= bounds[k + 2]]
            kept_upto = nxt[0]["step"] if nxt else 0
        else:
            kept_upto = float("inf")
        for m in mine:
            b["productive" if m["step"] <= kept_upto else "lost"] += m["step_time_s"]
        first_start = (mine[0]["time"] - mine[0]["step_time_s"]) if mine else None
        b["startup" if k == 0 else "restart"] += ((first_start if first_start is not None else
                                                   (failure["fault_time"] if failure else end)) - start)
        if failure is not None:
            fault = min(failure["fault_time"], end)
            if mine:
                b["lost"] += max(0.0, fault - mine[-1]["time"])
            b["detection"] += end - fault
            rec = recovered.get(failure.get("attempt", k) + 1, {})
            out_failures.append({
                "kind": failure["kind"], "injected": failure.get("injected"), "rank": failure["rank"],
                "step": failure["step"], "detection_latency_s": failure["detection_latency_s"],
                "recovery_s": rec.get("recovery_s"), "fault_to_step_s": rec.get("fault_to_step_s"),
                "steps_recomputed": rec.get("steps_recomputed"), "decision": failure.get("decision")})
    for e in events:
        if e.get("event") == "checkpoint_saved" and t_begin <= e["time"] <= t_end:
            b["checkpoint"] += e.get("stall_s", 0.0) if e.get("async_save") else e.get("seconds", 0.0)
    wall = max(t_end - t_begin, 1e-9)
    b["other"] = max(0.0, wall - sum(v for k, v in b.items() if k != "other"))
    return {"wall_s": wall, "buckets": b, "ettr": b["productive"] / wall, "failures": out_failures,
            "restarts": len([e for e in events if e.get("event") == "restart"]),
            "steps_recomputed": sum(f["steps_recomputed"] or 0 for f in out_failures)}


def account_run(run_dir: str | Path) -> dict[str, Any]:
    run_dir = Path(run_dir)
    return account(read_jsonl(run_dir / "events.jsonl"), read_jsonl(run_dir / "metrics.jsonl"))


def format_report(g: dict[str, Any]) -> str:
    wall = g["wall_s"]
    lines = ["== goodput ==", f"  wall time       {wall:.1f} s",
             f"  ETTR            {100 * g['ettr']:.1f}% (productive / wall)"]
    for k in BUCKETS:
        v = g["buckets"][k]
        lines.append(f"  {k:<15} {v:8.2f} s  {100 * v / wall:5.1f}%")
    if g["failures"]:
        lines.append(f"  failures        {len(g['failures'])} ({g.get('restarts', 0)} restarts, "
                     f"{g.get('steps_recomputed', 0)} steps recomputed)")
        for f in g["failures"]:
            rec = "-" if f["fault_to_step_s"] is None else f"{f['fault_to_step_s']:.2f} s"
            lines.append(f"    {f['kind']:<12} rank {f['rank']} step {f['step']:<5} "
                         f"{'(injected ' + f['injected'] + ') ' if f['injected'] else ''}detected in "
                         f"{f['detection_latency_s']:.2f} s, next step after {rec}, "
                         f"{f['steps_recomputed'] if f['steps_recomputed'] is not None else '-'} recomputed")
    return "\n".join(lines)
