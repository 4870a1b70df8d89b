"""Analysis of flight-recorder dumps (``<run_dir>/flight/rank-<r>.json``): who is stuck, and where.

Pure functions over the dumps; ``stalwart diagnose`` prints :func:`format_diagnosis`.

For every process group the collective sequence numbers of all member ranks must advance together.
The first collective ``#k`` some member entered and another did not is where the job diverged: the
ranks that never entered it are the culprits (stuck elsewhere, crashed, or skipping a collective), the
ranks waiting inside it are victims. Entries with the same ``seq`` but a different op or sizes on two
ranks are reported as mismatches (a desynchronised program).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from stalwart.paths import RunPaths, rank_files


def load_dumps(run_dir: str | Path, skipped: list[str] | None = None) -> dict[int, dict[str, Any]]:
    """Every rank's flight-recorder dump by rank; a file that is not a dump is left out (and described
    in ``skipped``, when given)."""
    out: dict[int, dict[str, Any]] = {}
    for rank, p in rank_files(RunPaths(run_dir).flight_dir, ".json").items():
        try:
            d = json.loads(p.read_text())
            if not isinstance(d, dict) or not isinstance(d.get("entries", []), list):
                raise ValueError("not a flight-recorder dump")
            out[int(d.get("rank", rank))] = d
        except (OSError, UnicodeDecodeError, ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
            if skipped is not None:
                skipped.append(f"{p} ({e})")
    return out


def newest_attempt(dumps: dict[int, dict[str, Any]], events: list[dict[str, Any]]) -> tuple[dict, dict]:
    """The dumps of the newest attempt that wrote any (a launch and its restart count), and what that
    attempt is: ``{"job", "attempt", "time", "older_dumps", "superseded_by"}``. ``superseded_by`` is
    the event (a later ``start``, ``finished`` or ``stopped``) showing the run went on after them."""
    key = lambda d: (d.get("job", ""), int(d.get("attempt", 0)))  # noqa: E731
    newest = max(dumps.values(), key=lambda d: d.get("time", 0.0))
    mine = {r: d for r, d in dumps.items() if key(d) == key(newest)}
    last = max(d.get("time", 0.0) for d in mine.values())
    later = [e for e in events if e.get("event") in ("start", "finished", "stopped", "restart")
             and e.get("time", 0.0) > last]
    info = {"job": key(newest)[0], "attempt": key(newest)[1], "time": last, "older_dumps": sorted(set(dumps) - set(mine)),
            "superseded_by": later[-1] if later else None}
    return mine, info


def _rank_state(d: dict[str, Any]) -> dict[str, Any]:
    now = d.get("time", 0.0)
    entries = d.get("entries", [])
    done = [e for e in entries if e["state"] == "completed"]
    flying = [e for e in entries if e["state"] in ("started", "issued")]
    failed = [e for e in entries if e["state"] == "failed"]

    def brief(e: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
        if e is None:
            return None
        return {"op": e["op"], "seq": e["seq"], "group": e["group"], "sizes": e.get("sizes"),
                "step": e.get("step"), "phase": e.get("phase"), "age_s": now - (e[key] or now)}

    return {"rank": d.get("rank"), "reason": d.get("reason"), "step": d.get("step"), "phase": d.get("phase"),
            "phase_age_s": now - d["phase_since"] if d.get("phase_since") else None,
            "last_completed": brief(done[-1] if done else None, "t_end"),
            "in_flight": brief(flying[0] if flying else None, "t_start"),
            "failed": brief(failed[-1] if failed else None, "t_start"),
            "error": failed[-1].get("error") if failed else None,
            "earlier_reasons": d.get("earlier_reasons", [])}


def analyze(dumps: dict[int, dict[str, Any]], world_size: int | None = None) -> dict[str, Any]:
    """Everything ``stalwart diagnose`` reports, as data."""
    if world_size is None:
        world_size = max([d.get("world_size", 0) for d in dumps.values()] + [max(dumps, default=-1) + 1])
    ranks = {r: _rank_state(d) for r, d in sorted(dumps.items())}
    missing = [r for r in range(world_size) if r not in dumps]

    # per group: rank -> {seq: entry} for collectives (p2p excluded)
    groups: dict[str, dict[str, Any]] = {}
    for r, d in dumps.items():
        for e in d.get("entries", []):
            if e.get("p2p"):
                continue
            g = groups.setdefault(e["group"], {"members": set(), "seqs": {}})
            if e.get("group_ranks"):
                g["members"].update(e["group_ranks"])
            g["members"].add(r)
            g["seqs"].setdefault(r, {})[e["seq"]] = e
    findings = []
    mismatches = []
    for name, g in sorted(groups.items()):
        members = sorted(g["members"])
        entered = {r: max(g["seqs"][r]) if g["seqs"].get(r) else -1 for r in members if r in dumps}
        if not entered:
            continue
        top = max(entered.values())
        k = min(entered.values()) + 1
        if k <= top:
            behind = sorted(r for r, s in entered.items() if s < k)
            waiting = sorted(r for r, s in entered.items() if s >= k)
            sample = next(g["seqs"][r][k] for r in waiting if k in g["seqs"][r])
            findings.append({"group": name, "seq": k, "op": sample["op"], "sizes": sample.get("sizes"),
                             "never_entered": behind, "entered": waiting,
                             "no_dump": [r for r in members if r not in dumps]})
        common = set.intersection(*(set(s) for s in g["seqs"].values())) if g["seqs"] else set()
        for seq in sorted(common):
            sig = {r: (g["seqs"][r][seq]["op"], g["seqs"][r][seq].get("sizes")) for r in g["seqs"]}
            if len({json.dumps(v) for v in sig.values()}) > 1:
                mismatches.append({"group": name, "seq": seq,
                                   "by_rank": {r: {"op": o, "sizes": s} for r, (o, s) in sig.items()}})
                if len(mismatches) >= 10:
                    break
    culprits = sorted({r for f in findings for r in f["never_entered"]} | set(missing))
    return {"world_size": world_size, "ranks": ranks, "missing_dumps": missing, "findings": findings,
            "mismatches": mismatches, "suspect_ranks": culprits}


def _op(b: dict[str, Any] | None, age_word: str) -> str:
    if b is None:
        return "none"
    where = f" (step {b['step']}, phase {b['phase']})" if b.get("step") is not None else ""
    return f"{b['op']} #{b['seq']} on {b['group']} {b.get('sizes') or ''}, {age_word} {b['age_s']:.1f}s ago{where}"


def format_diagnosis(a: dict[str, Any]) -> str:
    lines = [f"flight-recorder dumps: {len(a['ranks'])} of {a['world_size']} ranks"]
    att = a.get("attempt")
    if att:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(att["time"]))
        lines[0] += f", from attempt {att['attempt']} of launch {att['job'] or '-'} (newest dump {when})"
        if att["older_dumps"]:
            lines.append(f"  rank(s) {att['older_dumps']}: only dumps of an earlier attempt, left out")
        if att["superseded_by"]:
            ev = att["superseded_by"]
            lines.append(f"  HISTORY: the run went on after these dumps ({ev['event']} at step {ev.get('step', '-')}, "
                         f"{time.strftime('%H:%M:%S', time.localtime(ev['time']))}); they describe that earlier "
                         "attempt, not the run's current state")
    if a["missing_dumps"]:
        lines.append(f"  no dump from rank(s) {a['missing_dumps']} (process dead, or recorder not installed)")
    if not a["findings"] and not a["mismatches"]:
        lines.append("no divergence: every rank entered the same collectives")
    for f in a["findings"]:
        lines.append(f"DIVERGENCE on group {f['group']}: collective #{f['seq']} ({f['op']} {f['sizes']}) was "
                     f"entered by rank(s) {f['entered']} but NEVER entered by rank(s) {f['never_entered']}")
    for m in a["mismatches"]:
        lines.append(f"MISMATCH on group {m['group']} #{m['seq']}: " +
                     "; ".join(f"rank {r}: {v['op']} {v['sizes']}" for r, v in m["by_rank"].items()))
    if a["suspect_ranks"]:
        lines.append(f"suspect rank(s): {a['suspect_ranks']}")
    lines.append("")
    lines.append("per rank:")
    for r, s in a["ranks"].items():
        phase_age = f" for {s['phase_age_s']:.1f}s" if s["phase_age_s"] is not None and s["phase"] else ""
        lines.append(f"  rank {r}: step {s['step']}, phase {s['phase'] or '-'}{phase_age}; dump reason: {s['reason']}")
        lines.append(f"    last completed: {_op(s['last_completed'], 'finished')}")
        lines.append(f"    in flight:      {_op(s['in_flight'], 'started')}")
        if s["failed"]:
            lines.append(f"    failed:         {_op(s['failed'], 'started')}: {s['error']}")
        if s["earlier_reasons"]:
            lines.append(f"    earlier dumps:  {'; '.join(s['earlier_reasons'][-3:])}")
    return "\n".join(lines)
