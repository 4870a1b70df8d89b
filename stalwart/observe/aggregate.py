"""Merging per-rank timings, the rank x step heat map, straggler scores and the goodput breakdown.

All pure functions over records read from a run directory (docs/run-directory.md); no process talks
to another to produce them, so computing them never blocks training.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterable

from stalwart.metrics.records import read_jsonl

# Phases in which a rank waits for others: a high score there marks a victim, not a straggler.
WAIT_PHASES = ("comm", "comm_wait")


def _tail(path: Path, tail_bytes: int) -> list[dict[str, Any]]:
    with path.open("rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - tail_bytes))
        lines = f.read().decode("utf-8", "replace").splitlines()
    if size > tail_bytes:
        lines = lines[1:]  # a partial first line
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def load_timings(run_dir: str | Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """All ranks' timing records; on a resumed run a step's newest record per rank wins.

    ``tail_bytes`` reads only the end of each rank's file: cheap enough for rank 0 (or a sidecar) to
    compute live straggler scores every N steps of a long run without talking to the other ranks.
    """
    latest: dict[tuple[int, int], dict[str, Any]] = {}
    for p in sorted((Path(run_dir) / "timings").glob("rank-*.jsonl")):
        for r in (read_jsonl(p) if tail_bytes is None else _tail(p, tail_bytes)):
            if "step" in r and "rank" in r:
                latest[(r["rank"], r["step"])] = r
    return [latest[k] for k in sorted(latest)]


def phase_value(rec: dict[str, Any], field: str) -> float | None:
    if field == "step_time_s":
        return rec.get("step_time_s")
    return (rec.get("phases") or {}).get(field)


def phase_names(records: Iterable[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        for k in r.get("phases") or {}:
            seen.setdefault(k, None)
    return list(seen)


def heatmap(records: list[dict[str, Any]], field: str = "step_time_s", last_steps: int | None = None
            ) -> dict[str, Any]:
    """A rank x step matrix of ``field`` (``step_time_s`` or a phase name); missing cells are None."""
    ranks = sorted({r["rank"] for r in records})
    steps = sorted({r["step"] for r in records})
    if last_steps:
        steps = steps[-last_steps:]
    col = {s: i for i, s in enumerate(steps)}
    row = {r: i for i, r in enumerate(ranks)}
    matrix: list[list[float | None]] = [[None] * len(steps) for _ in ranks]
    for rec in records:
        if rec["step"] in col:
            matrix[row[rec["rank"]]][col[rec["step"]]] = phase_value(rec, field)
    return {"field": field, "ranks": ranks, "steps": steps, "matrix": matrix}


def straggler_scores(records: list[dict[str, Any]], threshold: float = 1.2, min_abs_s: float = 1e-3,
                     skip_first: int = 1) -> dict[str, Any]:
    """Per phase and rank: the rank's median time divided by the fastest rank's median.

    A rank is flagged in a phase when its score is at least ``threshold`` and it is at least
    ``min_abs_s`` slower than the fastest (tiny phases are noise). The first ``skip_first`` steps of
    each rank (warm-up) are ignored. ``suspects`` are ranks flagged in a phase that is not a wait
    phase (communication): the slow rank makes everyone else wait in ``comm``.
    """
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_rank.setdefault(r["rank"], []).append(r)
    for rs in by_rank.values():
        rs.sort(key=lambda r: r["step"])
        del rs[: min(skip_first, max(0, len(rs) - 1))]
    fields = ["step_time_s"] + phase_names(records)
    rows = []
    for f in fields:
        med = {}
        for rank, rs in by_rank.items():
            vals = [v for v in (phase_value(r, f) for r in rs) if v is not None]
            if vals:
                med[rank] = statistics.median(vals)
        if not med:
            continue
        fastest = min(med.values())
        for rank in sorted(med):
            score = med[rank] / fastest if fastest > 0 else (1.0 if med[rank] == 0 else float("inf"))
            flagged = score >= threshold and med[rank] - fastest >= min_abs_s
            rows.append({"phase": f, "rank": rank, "median_s": med[rank], "fastest_s": fastest,
                         "score": score, "flagged": flagged, "wait": f in WAIT_PHASES})
    suspects = sorted({r["rank"] for r in rows
                       if r["flagged"] and r["phase"] not in WAIT_PHASES and r["phase"] != "step_time_s"})
    return {"threshold": threshold, "rows": rows, "suspects": suspects}


def goodput(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where the wall-clock time of a run (all its restarts) went; None without events.

    productive: step time of the steps that survived (the newest record of each step; a step logged
    every k steps stands for k steps); checkpoint: ``checkpoint_saved.seconds``; downtime: from a
    ``failure``/``restart`` event to the next ``start``/``resumed``; lost: step time of steps that
    were recomputed after a restart; other: the rest (start-up, evaluation, logging).
    """
    if not events:
        return None
    times = [e["time"] for e in events if isinstance(e.get("time"), (int, float))]
    times += [m["time"] for m in metrics if isinstance(m.get("time"), (int, float))]
    wall = max(times) - min(times) if times else 0.0
    ckpt = sum(float(e.get("seconds") or 0) for e in events if e.get("event") == "checkpoint_saved")
    downtime, down_since = 0.0, None
    for e in sorted(events, key=lambda e: e.get("time", 0)):
        if e.get("event") in ("failure", "restart") and down_since is None:
            down_since = e["time"]
        elif e.get("event") in ("start", "resumed") and down_since is not None:
            downtime += e["time"] - down_since
            down_since = None
    train = [m for m in metrics if "loss" in m and isinstance(m.get("step_time_s"), (int, float))]
    newest: dict[int, int] = {}
    for i, m in enumerate(train):
        newest[m["step"]] = i
    productive = lost = 0.0
    prev_step = 0
    for i, m in enumerate(train):
        span = max(1, m["step"] - prev_step) if m["step"] > prev_step else 1
        prev_step = m["step"]
        if newest[m["step"]] == i:
            productive += m["step_time_s"] * span
        else:
            lost += m["step_time_s"] * span
    other = max(0.0, wall - productive - ckpt - downtime - lost)
    parts = {"productive": productive, "checkpoint": ckpt, "downtime": downtime, "lost_work": lost,
             "other": other}
    counts = {k: sum(1 for e in events if e.get("event") == k)
              for k in ("failure", "restart", "resumed", "checkpoint_saved", "checkpoint_failed")}
    return {"wall_s": wall, "parts_s": parts, "goodput": productive / wall if wall > 0 else None,
            "counts": counts}
