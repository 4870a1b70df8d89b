"""Where a job's ranks live, and what a fault did to the replica groups it did not hit.

A job is ``R`` replica groups of ``S`` ranks each. With ``fault.group_recovery`` each group trains in
its own directory (``RunPaths.replica_group``: group 0 in the run directory, group g in ``groups/<g>``)
with its own heartbeats, events, metrics, snapshots and checkpoints, and fails and recovers alone
(docs/group-recovery.md); a job without it is one group of all its ranks. The drill names a rank by its
place in the job, ``g * S + r``; every file names it by ``r``, its rank inside group ``g``.

The readings here are pure: they take what the run wrote (each group's events and step times) and say
how often the groups a fault did not hit were restarted, how long they stalled redoing the lost
group's micro-batches (``group_step_redone``), and whether every group's steps equal the reference's.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from stalwart.errors import UserError
from stalwart.paths import RunPaths

GROUP_KINDS = ("group_kill", "all_groups")  # only against a job of replica groups
StepTimes = dict[int, list[tuple[int, float, float]]]  # group -> (step, time logged, step_time_s) in order


@dataclass(frozen=True)
class Layout:
    groups: int          # R (1 for a job without fault.group_recovery)
    size: int            # S, ranks per group
    grouped: bool = False

    @classmethod
    def of(cls, cfg, nproc: int) -> "Layout":
        """From the parsed train command line (``cfg``) and its process count."""
        if not cfg.fault.group_recovery:
            return cls(1, nproc)
        if cfg.fault.replica_group >= 0:
            raise UserError("stalwart chaos runs every replica group on this host: drop --fault.replica_group")
        groups = cfg.parallelism.dp_replicate
        if nproc % groups:
            raise UserError(f"--nproc-per-node {nproc} does not split into {groups} replica groups "
                            "(parallelism.dp_replicate)")
        return cls(groups, nproc // groups, True)

    @property
    def nproc(self) -> int:
        return self.groups * self.size

    def where(self, rank: int) -> tuple[int, int]:
        """(group, rank inside it) of the job's rank ``rank``."""
        return divmod(rank, self.size)

    def ranks(self, group: int) -> range:
        return range(group * self.size, (group + 1) * self.size)

    def dirs(self, run: Path) -> list[RunPaths]:
        """Each group's run directory."""
        return [RunPaths(run).replica_group(g) for g in range(self.groups)]

    def hit(self, kind: str, victim: int) -> list[int]:
        """The job's ranks that fault ``kind`` aimed at rank ``victim`` signals: the victim's whole group
        (``group_kill``), its rank in every group (``all_groups``; a corrupted snapshot in a job of groups,
        whose restart must then read its own snapshots: a restarted group alone takes its peers' memory),
        else the victim."""
        group, rank = self.where(victim)
        if kind == "group_kill":
            return list(self.ranks(group))
        if kind == "all_groups" or (kind == "corrupt_snapshot" and self.grouped):
            return [g * self.size + rank for g in range(self.groups)]
        return [victim]

    def groups_hit(self, kind: str, victim: int) -> list[int]:
        return sorted({self.where(r)[0] for r in self.hit(kind, victim)})


def read_events(path: Path) -> list[dict]:
    """The records of an ``events.jsonl`` (a line being written is skipped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_step_times(path: Path) -> list[tuple[int, float, float]]:
    """``(step, time logged, step_time_s)`` of every step line of a ``metrics.jsonl``, in order (a step
    trained again after a whole start is there twice)."""
    return [(int(rec["step"]), float(rec.get("time", 0)), float(rec["step_time_s"])) for rec in read_events(path)
            if "step" in rec and rec.get("step_time_s") is not None]


def restarts(events: dict[int, list[dict]], groups: list[int], t0: float, t1: float) -> int:
    """``restart`` events of ``groups``' supervisors in ``[t0, t1)``."""
    return sum(1 for g in groups for e in events.get(g, [])
               if e.get("event") == "restart" and t0 <= e.get("time", 0) < t1)


def stalls(events: dict[int, list[dict]], step_times: StepTimes, groups: list[int], t0: float,
           t1: float) -> list[dict]:
    """What the lost group cost each of ``groups`` in ``[t0, t1)``: each ``group_step_redone`` (its wait for
    the new epoch) and the redone step's time (its first line logged after the event) beside the group's
    median step."""
    out = []
    for g in groups:
        times = step_times.get(g, [])
        median = statistics.median(x for _, _, x in times) if times else None
        for e in events.get(g, []):
            if e.get("event") == "group_step_redone" and t0 <= e.get("time", 0) < t1:
                step = e.get("step")
                took = next((x for s, t, x in times if s == step and t >= e["time"]), None)
                out.append({"group": g, "step": step, "lost": e.get("lost"), "wait_s": e.get("wait_s"),
                            "step_time_s": round(took, 4) if took is not None else None,
                            "median_step_s": round(median, 4) if median is not None else None})
    return out


def rejoins(launcher: list[dict], groups: list[int], t0: float, t1: float) -> list[dict]:
    """The launcher's ``group_lost`` and ``group_rejoined`` of ``groups`` in ``[t0, t1)``, and whether the
    job fell back to a whole start (every group lost)."""
    out = []
    for e in launcher:
        if not t0 <= e.get("time", 0) < t1:
            continue
        if e.get("event") == "group_lost" and e.get("group") in groups:
            out.append({"event": "lost", "group": e["group"], "lighthouse_s": e.get("lighthouse_s")})
        elif e.get("event") == "group_rejoined" and e.get("group") in groups:
            out.append({"event": "rejoined", "group": e["group"], "away_s": e.get("away_s")})
        elif e.get("event") == "group_whole_job_fallback":
            out.append({"event": "whole_job_fallback"})
    return out


def effects(rec: dict, events: dict[int, list[dict]], step_times: StepTimes, t0: float, t1: float) -> dict:
    """What the fault ``rec`` (sent at ``t0``; the next at ``t1``) did to the groups: restarts of those it
    hit and of the others (``survivor_restarts``: 0 unless something is wrong, a fault that hits every
    group leaving no survivor), the survivors' redone steps, and the lighthouse's record of the loss."""
    hit = rec["groups"]
    survivors = [g for g in sorted(events) if g not in hit]
    out = {"restarts": restarts(events, hit, t0, t1), "survivor_restarts": restarts(events, survivors, t0, t1),
           "survivor_stall": stalls(events, step_times, survivors, t0, t1),
           "lighthouse": rejoins(events.get(0, []), hit, t0, t1)}
    if out["survivor_restarts"]:
        out["survivors_restarted"] = [g for g in survivors if restarts(events, [g], t0, t1)]
    return out


def compare(reference: Path, run: Path, layout: Layout, steps: int) -> tuple[bool, str]:
    """Every group's every logged step against the reference's (the same group's directory there, or the
    reference's own for a reference without groups): the whole state fingerprint, or, where only that
    differs, the weights, optimizer state and loss (``data`` depends on the number of ranks in a run
    without groups). Equal only when every step was logged by some group, every group logged the last,
    and nothing differs."""
    from stalwart.observe.fingerprints import first_difference, read_fingerprints  # observe loads torch

    same_whole, lines, union = True, [], set()
    for g, paths in enumerate(layout.dirs(run)):
        ref_dir = RunPaths(reference).replica_group(g).root
        ref = read_fingerprints(ref_dir if ref_dir.is_dir() else reference)
        got = read_fingerprints(paths.root) if paths.metrics.is_file() else {}
        union |= set(got)
        if steps not in got:
            lines.append(f"group {g} did not log the last step ({max(got, default=0)} of {steps})")
        step, common = first_difference(ref, got)
        if step is None:
            continue
        same_whole = False
        bad = [s for s in common if (ref[s]["loss"], *(ref[s]["parts"].get(k) for k in ("params", "optim"))) !=
               (got[s]["loss"], *(got[s]["parts"].get(k) for k in ("params", "optim")))]
        if bad:
            parts = [k for k in ("params", "optim") if ref[bad[0]]["parts"].get(k) != got[bad[0]]["parts"].get(k)]
            lines.append(f"group {g} differs first at step {bad[0]} ({', '.join(parts) or 'loss'})")
    ref_steps = set(read_fingerprints(reference))
    if union != ref_steps:
        lines.append(f"the groups logged {len(union)} steps, the reference {len(ref_steps)}")
    if lines:
        return False, "; ".join(lines)
    what = "state fingerprint" if same_whole else "weights, optimizer state and loss (the whole fingerprint differs)"
    return True, (f"identical: every group's logged steps ({len(union)} steps, 1-{max(union)}, in {layout.groups} "
                  f"groups) have the same {what}")
