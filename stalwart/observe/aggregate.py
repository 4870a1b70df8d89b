"""Merging per-rank timings, the rank x step heat map and straggler scores (goodput: observe/goodput.py).

All pure functions over records read from a run directory (docs/run-directory.md); no process talks
to another to produce them, so computing them never blocks training.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterable

from stalwart.metrics.records import read_jsonl
from stalwart.paths import RunPaths, rank_files

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
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def load_timings(run_dir: str | Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """All ranks' timing records; on a resumed run a step's newest record per rank wins.

    ``tail_bytes`` reads only the end of each rank's file: cheap enough for rank 0 (or a sidecar) to
    compute live straggler scores every N steps of a long run without talking to the other ranks.
    """
    latest: dict[tuple[int, int], dict[str, Any]] = {}
    for p in rank_files(RunPaths(run_dir).timings_dir, ".jsonl").values():
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
