"""Goodput: where a run's wall time went, from events.jsonl and metrics.jsonl (pure; no torch, no clock).

The one calculation behind ``stalwart goodput``, the supervisor's end-of-run report (``goodput.json``),
the dashboard and ``stalwart report``. Wall time runs from the supervisor's ``launch`` to its last
``supervisor_exit`` (without them: the first to the last record) and is split into:

- productive   step time of steps whose result was kept
- lost         step time of steps recomputed after a failure, plus the partial step cut off by the fault
- detection    fault -> the supervisor noticing it (per failure: ``detection_latency_s``)
- restart      detection -> the first step of the next attempt starts (stop, rendezvous, rebuild, resume)
- checkpoint   the training loop's stall for checkpoint saves (``stall_s``; whole save when synchronous)
- startup      launch -> the first step of the first attempt starts
- group_loss   under ``fault.group_recovery``, what another replica group's loss cost this one without a
               restart: each redone step's time beyond the median step (``group_step_redone``), and the
               rejoin transfers it sent or received (``group_transfer``); its own failures are restarts
- other        the rest: evaluation, logging, the final evaluation/sample, shutdown

ETTR (effective training time ratio) = productive / wall; the buckets sum to the wall time.

Attempts are bounded by the supervisor's ``failure`` events (those with a ``detect_time``; the
trainer's own loss-spike and non-finite reports carry none), and each failure is paired with the
``recovered`` event of the attempt after it by time, since attempt numbers start again at 0 in every
launch that appends to one events.jsonl. A step record is kept when no later
record of the same step exists (a resume without a supervisor recomputes steps too) and, in an
attempt that ended in a failure, when the next attempt resumed at or after it. A logged step stands
for the steps since the previous logged one of its attempt (or its ``resumed`` step): with
``metrics.log_interval`` > 1 their time is estimated from the logged step's (at most the time since
the previous record); with 1 the split is exact.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from stalwart.metrics.records import read_jsonl
from stalwart.paths import RunPaths

BUCKETS = ("productive", "lost", "detection", "restart", "checkpoint", "startup", "group_loss", "other")
# Events whose number the accounting reports (how many of each events.jsonl holds).
COUNTED = ("failure", "restart", "resumed", "recovered", "checkpoint_saved", "checkpoint_failed")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def account(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The accounting of one run; None without timed events (nothing bounds the run)."""
    events = sorted((e for e in events if _num(e.get("time"))), key=lambda e: e["time"])
    if not events:
        return None
    steps = sorted((m for m in metrics if "loss" in m and "step" in m and _num(m.get("step_time_s"))
                    and _num(m.get("time"))), key=lambda m: m["time"])
    newest = {m["step"]: i for i, m in enumerate(steps)}  # a recomputed step's later record wins
    times = [e["time"] for e in events] + [m["time"] for m in steps]
    launch = next((e for e in events if e.get("event") == "launch"), None)
    t_begin = launch["time"] if launch else min(times)
    exits = [e for e in events if e.get("event") == "supervisor_exit"]
    t_end = exits[-1]["time"] if exits else max(times)
    failures = sorted((e for e in events if e.get("event") == "failure" and _num(e.get("detect_time"))),
                      key=lambda e: e["detect_time"])
    resumed = [e for e in events if e.get("event") == "resumed" and "step" in e]
    recovered = [e for e in events if e.get("event") == "recovered"]

    # Attempt k runs from its start (launch, or the previous failure's detection) to its failure's detection.
    bounds = [t_begin] + [f["detect_time"] for f in failures] + [t_end]
    b = {k: 0.0 for k in BUCKETS}
    out_failures = []
    for k in range(len(bounds) - 1):
        start, end = bounds[k], bounds[k + 1]
        mine = [(i, m) for i, m in enumerate(steps) if start < m["time"] <= end]
        failure = failures[k] if k < len(failures) else None
        fault = min(failure.get("fault_time", end), end) if failure is not None else end
        if failure is not None:
            nxt = [e for e in resumed if end < e["time"] <= bounds[k + 2]]
            kept_upto = nxt[0]["step"] if nxt else 0
        else:
            kept_upto = math.inf
        prev, prev_time, first_start = 0, start, None
        for i, m in mine:
            prev = next((e["step"] for e in reversed(resumed) if prev_time <= e["time"] <= m["time"]), prev)
            seconds = m["step_time_s"]
            if m["step"] > prev + 1:  # it stands for the unlogged steps before it: never more than elapsed
                seconds = min(seconds * (m["step"] - prev), m["time"] - prev_time)
            prev, prev_time = max(prev, m["step"]), m["time"]
            first_start = max(start, m["time"] - seconds) if first_start is None else first_start
            b["productive" if newest[m["step"]] == i and m["step"] <= kept_upto else "lost"] += seconds
        b["startup" if k == 0 else "restart"] += max(0.0, (fault if first_start is None else first_start) - start)
        if failure is not None:
            if mine:
                b["lost"] += max(0.0, fault - mine[-1][1]["time"])
            b["detection"] += end - fault
            nxt_detect = failures[k + 1]["detect_time"] if k + 1 < len(failures) else math.inf
            rec = _recovery_of(failure, recovered, nxt_detect)
            out_failures.append({
                "kind": failure.get("kind"), "injected": failure.get("injected"), "rank": failure.get("rank"),
                "step": failure.get("step"), "detection_latency_s": failure.get("detection_latency_s", end - fault),
                "recovery_s": rec.get("recovery_s"), "fault_to_step_s": rec.get("fault_to_step_s"),
                "steps_recomputed": rec.get("steps_recomputed"), "decision": failure.get("decision")})
    _group_losses(b, events, steps, newest)
    for e in events:
        if e.get("event") == "checkpoint_saved" and t_begin <= e["time"] <= t_end:
            b["checkpoint"] += float(e.get("stall_s" if e.get("async_save") else "seconds") or 0.0)
    wall = max(t_end - t_begin, 1e-9)
    b["other"] = max(0.0, wall - sum(v for k, v in b.items() if k != "other"))
    return {"wall_s": wall, "ettr": b["productive"] / wall, "buckets": b, "failures": out_failures,
            "steps_recomputed": sum(f["steps_recomputed"] or 0 for f in out_failures),
            "counts": {name: sum(1 for e in events if e.get("event") == name) for name in COUNTED}}


def _recovery_of(failure: dict[str, Any], recovered: list[dict[str, Any]], next_detect: float) -> dict[str, Any]:
    """The ``recovered`` event of ``failure``: the first after its detection and no later than the next
    failure's (the attempt that follows it), or {} when that attempt never completed a step. By time,
    not by attempt number: attempts count from 0 again in every launch (a relaunch after an exclusion,
    a rerun of the run directory), so an attempt number names several recoveries in one events.jsonl."""
    return next((e for e in recovered if failure["detect_time"] <= e["time"] <= next_detect), {})


def _group_losses(b: dict[str, float], events: list[dict[str, Any]], steps: list[dict[str, Any]],
                  newest: dict[int, int]) -> None:
    """Move what other replica groups' losses cost this group from productive to ``group_loss``."""
    redone = {e["step"] for e in events if e.get("event") == "group_step_redone" and "step" in e}
    if redone:
        kept = [steps[i] for i in newest.values()]
        times = sorted(m["step_time_s"] for m in kept)
        median = times[len(times) // 2]
        for m in kept:
            if m["step"] in redone:
                excess = max(0.0, m["step_time_s"] - median)
                b["productive"] -= excess
                b["group_loss"] += excess
    b["group_loss"] += sum(float(e.get("seconds") or 0.0) for e in events if e.get("event") == "group_transfer")


def account_run(run_dir: str | Path) -> dict[str, Any] | None:
    """:func:`account` of a run directory's events.jsonl and metrics.jsonl."""
    paths = RunPaths(run_dir)
    return account(read_jsonl(paths.events), read_jsonl(paths.metrics))


def format_report(g: dict[str, Any]) -> str:
    """The accounting as the text ``stalwart goodput`` and the supervisor print."""
    wall = g["wall_s"]
    lines = ["== goodput ==", f"  wall time       {wall:.1f} s",
             f"  ETTR            {100 * g['ettr']:.1f}% (productive / wall)"]
    for k in BUCKETS:
        v = g["buckets"][k]
        lines.append(f"  {k:<15} {v:8.2f} s  {100 * v / wall:5.1f}%")
    if g["failures"]:
        lines.append(f"  failures        {len(g['failures'])} ({g['counts']['restart']} restarts, "
                     f"{g['steps_recomputed']} steps recomputed)")
        for f in g["failures"]:
            rec = "-" if f["fault_to_step_s"] is None else f"{f['fault_to_step_s']:.2f} s"
            lines.append(f"    {f['kind']:<12} rank {f['rank']} step {f['step']:<5} "
                         f"{'(injected ' + f['injected'] + ') ' if f['injected'] else ''}detected in "
                         f"{f['detection_latency_s']:.2f} s, next step after {rec}, "
                         f"{f['steps_recomputed'] if f['steps_recomputed'] is not None else '-'} recomputed")
    return "\n".join(lines)
