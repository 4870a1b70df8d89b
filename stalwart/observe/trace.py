"""Chrome / Perfetto trace export of all ranks' phases (trace-event JSON format).

One process per rank (``pid`` = rank), one thread lane per phase (``tid``), one complete ("X") event
per phase per step, timestamps in microseconds from the earliest step in the window. Open the file in
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

from typing import Any

from stalwart.observe.aggregate import phase_names


def build_trace(records: list[dict[str, Any]], first_step: int | None = None, last_step: int | None = None
                ) -> dict[str, Any]:
    recs = [r for r in records if (first_step is None or r["step"] >= first_step)
            and (last_step is None or r["step"] <= last_step)]
    lanes = ["step"] + phase_names(recs)
    tid = {name: i for i, name in enumerate(lanes)}
    t0 = min((r["t_start"] for r in recs), default=0.0)
    events: list[dict[str, Any]] = []
    for rank in sorted({r["rank"] for r in recs}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for name, i in tid.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": i, "args": {"sort_index": i}})
    for r in recs:
        base = (r["t_start"] - t0) * 1e6
        events.append({"ph": "X", "name": f"step {r['step']}", "cat": "step", "pid": r["rank"], "tid": 0,
                       "ts": round(base, 3), "dur": round(r["step_time_s"] * 1e6, 3), "args": {"step": r["step"]}})
        starts = r.get("phase_starts") or {}
        cursor = 0.0  # records without phase_starts: lay phases end to end
        for name, dur in (r.get("phases") or {}).items():
            off = starts.get(name, cursor)
            events.append({"ph": "X", "name": name, "cat": "phase", "pid": r["rank"], "tid": tid[name],
                           "ts": round(base + off * 1e6, 3), "dur": round(dur * 1e6, 3),
                           "args": {"step": r["step"]}})
            cursor = off + dur
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "stalwart", "t0_unix_s": t0}}


def validate_trace(trace: Any) -> list[str]:
    """Problems with ``trace`` as trace-event JSON (the subset we emit); empty when valid."""
    errors: list[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["top level must be an object with a traceEvents list"]
    for i, e in enumerate(trace["traceEvents"]):
        if not isinstance(e, dict):
            errors.append(f"event {i}: not an object")
            continue
        ph = e.get("ph")
        if ph not in ("X", "M", "B", "E", "i", "C"):
            errors.append(f"event {i}: unknown ph {ph!r}")
        if not isinstance(e.get("name"), str):
            errors.append(f"event {i}: name must be a string")
        for k in ("pid", "tid"):
            if not isinstance(e.get(k), int):
                errors.append(f"event {i}: {k} must be an integer")
        if ph == "X":
            for k in ("ts", "dur"):
                if not isinstance(e.get(k), (int, float)) or e[k] < 0:
                    errors.append(f"event {i}: {k} must be a non-negative number")
        if ph == "M" and not isinstance(e.get("args"), dict):
            errors.append(f"event {i}: metadata needs args")
    return errors
