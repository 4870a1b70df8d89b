"""The fault log: each fault the drill sent beside what the run recorded about it (``<run>/chaos.jsonl``),
and the table per kind that ``stalwart chaos`` prints.

``annotate`` reads each group's ``events.jsonl`` (a job without replica groups is group 0): the
supervisor's ``failure`` (detection) and ``recovered`` (recovery), ``checkpoint_failed`` /
``checkpoint_saved`` for a full disk, ``resumed`` after corrupted snapshots, ``straggler`` for a slowed
rank; with replica groups also what the fault did to the groups it did not hit (``groups.effects``).
"""

from __future__ import annotations

import statistics

from stalwart.chaos import groups
from stalwart.chaos.faults import KINDS
from stalwart.chaos.groups import GROUP_KINDS, StepTimes


def _p50_max(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"


def _restored(rec: dict, events: list[dict], detected: float, recovered: float) -> dict:
    """What the restart after corrupting the snapshots restored (its ``resumed`` event, or none: a fresh start)."""
    resumed = next((e for e in events if e["event"] == "resumed" and detected <= e["time"] <= recovered), None)
    newest = max(rec.get("snapshot_steps") or [0])
    if resumed is None:
        return {"resumed": None, "outcome": f"snapshot step {newest} refused by its checksum; no disk checkpoint "
                                            "yet: started again from the seeded initialisation"}
    out = {"resumed": {"source": resumed.get("source"), "step": resumed.get("step")}}
    if resumed.get("source") != "memory":
        out["outcome"] = f"snapshot step {newest} refused by its checksum; resumed from disk step {resumed['step']}"
    elif resumed.get("step") in (rec.get("snapshot_steps") or []):
        out["outcome"] = f"restored the corrupted snapshot of step {resumed['step']}"
    else:
        out["outcome"] = f"restored a newer snapshot (step {resumed.get('step')}) than the corrupted ones"
    return out


def _failure(rec: dict, events: dict[int, list[dict]], t: float, nxt: float) -> tuple[int, dict] | None:
    """(group, the failure its supervisor recorded) for the fault sent at ``t``: the victim's group's, else
    the first any group recorded before the next fault."""
    found = sorted(((e["detect_time"], g, e) for g, evs in events.items() for e in evs
                    if e.get("event") == "failure" and t <= e.get("detect_time", 0) < nxt), key=lambda x: x[:2])
    own = [(g, e) for _, g, e in found if g == rec.get("group", 0)]
    return own[0] if own else (found[0][1:] if found else None)


def annotate(sent: list[dict], events: dict[int, list[dict]],
             step_times: StepTimes | None = None) -> list[dict]:
    """Each fault's record with what the run recorded about it (``events``: each group's, by group; a job
    without groups is group 0): its failure (detection), recovery; with replica groups also what it did
    to the groups it did not hit (``groups.effects``; ``step_times``: each group's step times)."""
    out = []
    for i, rec in enumerate(sent):
        t, until = rec["time"], rec["until"]
        nxt = sent[i + 1]["time"] if i + 1 < len(sent) else float("inf")
        mine = events.get(rec.get("group", 0), [])  # the victim's group's
        within = [e for e in mine if t <= e.get("detect_time", e.get("time", 0)) < nxt]
        row = {"time": round(t, 3), "t": rec["t"], "kind": rec["kind"],
               "target": {"rank": rec["rank"], "pid": rec["pid"], "step": rec["step"]},
               **{k: v for k, v in rec.items() if k not in ("time", "t", "kind", "rank", "pid", "step", "until", "freed")}}
        found = _failure(rec, events, t, nxt)
        fail = None
        if found is not None:
            group, fail = found
            row.update(detected_as={"rank": fail.get("rank"), "kind": fail.get("kind"), "phase": fail.get("phase"),
                                    "decision": fail.get("decision"), **({"group": group} if "group" in rec else {})},
                       detection_s=round(fail["detect_time"] - t, 3),
                       run_detection_latency_s=fail.get("detection_latency_s"))
            rec_ev = next((e for e in events[group] if e["event"] == "recovered" and
                           fail["detect_time"] <= e["time"] < nxt), None)
            if rec_ev is not None:
                row.update(recovery_s=rec_ev.get("recovery_s"),
                           fault_to_step_s=round(fail["detect_time"] + rec_ev.get("recovery_s", 0) - t, 3),
                           steps_recomputed=rec_ev.get("steps_recomputed"))
            if rec["kind"] == "corrupt_snapshot":
                row.update(_restored(rec, events[group], fail["detect_time"],
                                     rec_ev["time"] if rec_ev else float("inf")))
        if rec["kind"] == "disk_full":
            failed = next((e for e in within if e["event"] == "checkpoint_failed"), None)
            freed = rec.get("freed", until)
            saved = next((e for e in mine if e["event"] == "checkpoint_saved" and e["time"] >= freed), None)
            if failed is not None:
                row.update(detection_s=round(failed["time"] - t, 3), error=failed.get("error"),
                           outcome=f"save of step {failed.get('step')} failed, training went on")
            if saved is not None:
                row.update(recovery_s=round(saved["time"] - freed, 3), next_save_step=saved.get("step"))
        if rec["kind"] == "slow":
            flagged = next((e for e in mine if e["event"] == "straggler" and t <= e["time"] <= until + 10), None)
            row["outcome"] = (f"straggler rank {flagged.get('rank')} reported" if flagged else
                              "ridden out: slowed, not failed")
            if flagged:
                row["detection_s"] = round(flagged["time"] - t, 3)
        if rec["kind"] == "partition" and fail is None:
            row["outcome"] = "ridden out: connections resumed before any timeout"
        if "groups" in rec:
            row.update(groups.effects(rec, events, step_times or {}, t, nxt))
        if not rec.get("sent", True):
            row["outcome"] = "not delivered (the target left first)"
        out.append(row)
    return out


def summarize(rows: list[dict]) -> list[str]:
    grouped = any("groups" in r for r in rows)
    lines = [f"{'kind':<17} {'n':>3}  {'detected':>8}  {'detection s p50/max':>19}  {'recovery s p50/max':>18}"
             + ("  survivor restarts  survivors' wait s p50/max  redo step/median p50/max" if grouped else "")]
    for kind in KINDS + GROUP_KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            det = [r.get("detection_s") for r in mine]
            line = (f"{kind:<17} {len(mine):>3}  {sum(d is not None for d in det):>8}  {_p50_max(det):>19}  "
                    f"{_p50_max([r.get('recovery_s') for r in mine]):>18}")
            if grouped:
                redone = [s for r in mine for s in r.get("survivor_stall", [])]
                ratios = [s["step_time_s"] / s["median_step_s"] for s in redone
                          if s.get("step_time_s") and s.get("median_step_s")]
                line += (f"  {sum(r.get('survivor_restarts', 0) for r in mine):>17}  "
                         f"{_p50_max([s.get('wait_s') for s in redone]):>25}  {_p50_max(ratios):>24}")
            lines.append(line)
    return lines
