"""Fault injection plans: remember which faults fired, and draw chaos schedules.

The plan's grammar is ``stalwart.config.fault_plan`` (``parse_plan``). Every fault fires once: the
rank that fires it first writes a marker ``<run>/ft/fired/<id>.json`` (kind, rank, step, unix time),
and a restarted worker skips faults whose marker exists. ``once=0`` makes a fault fire on every
attempt (a deliberate crash loop). No torch.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from stalwart.atomic import write_json_atomic
from stalwart.config.fault_plan import CHAOS_KINDS, KINDS, Fault, FaultPlanError, parse_plan
from stalwart.paths import RunPaths

__all__ = ["CHAOS_KINDS", "KINDS", "ChaosSchedule", "Fault", "FaultPlanError", "fired_ids", "mark_fired",
           "parse_plan", "pending", "read_fired"]


# ---------------------------------------------------------------------- fired markers
def fired_ids(paths: RunPaths) -> set[str]:
    d = paths.fired_dir
    return {p.stem for p in d.glob("*.json")} if d.is_dir() else set()


def mark_fired(paths: RunPaths, fault: Fault, step: int, when: float, **extra) -> dict:
    """Durably record that ``fault`` fired (before it fires: a kill leaves no chance afterwards)."""
    paths.fired_dir.mkdir(parents=True, exist_ok=True)
    rec = {"id": fault.id, "kind": fault.kind, "rank": fault.rank, "step": step, "time": when,
           "spec": fault.describe(), **extra}
    write_json_atomic(paths.fired(fault.id), rec, indent=None)
    return rec


def read_fired(paths: RunPaths) -> list[dict]:
    d = paths.fired_dir
    out = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def pending(faults: list[Fault], fired: set[str]) -> list[Fault]:
    """The faults still to fire (a once-fault whose marker exists has already done its job)."""
    return [f for f in faults if not (f.once and f.id in fired)]


# ---------------------------------------------------------------------- chaos
@dataclass
class ChaosSchedule:
    """Random faults at a mean time between failures, reproducible from the seed.

    ``next_due(now)`` returns the faults due by ``now`` (seconds since the job started).
    """

    mtbf_s: float
    seed: int
    kinds: tuple[str, ...] = CHAOS_KINDS
    world_size: int = 1
    _rng: random.Random = field(init=False, repr=False)
    _next_t: float = field(init=False)

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in CHAOS_KINDS]
        if bad:
            raise FaultPlanError(f"fault.chaos_kinds: {bad[0]!r} is not one of {', '.join(CHAOS_KINDS)}")
        self._rng = random.Random(self.seed)
        self._next_t = self._rng.expovariate(1.0 / self.mtbf_s)

    def due(self, now: float) -> list[tuple[float, str, int]]:
        """(scheduled time, kind, rank) of every fault due by ``now``; each is returned once."""
        out = []
        while self._next_t <= now:
            out.append((self._next_t, self._rng.choice(self.kinds), self._rng.randrange(self.world_size)))
            self._next_t += self._rng.expovariate(1.0 / self.mtbf_s)
        return out
