"""Fault injection plans: remember which faults fired, and draw chaos schedules.

The plan's grammar is ``stalwart.config.fault_plan`` (``parse_plan``). Every fault fires once: the rank that fires it first writes a marker ``<run>/ft/fired/<id>.json``
(kind, rank, step, unix time), and a restarted worker skips faults whose marker exists. ``once=0``
makes a fault fire on every attempt (a deliberate crash loop). Pure logic; no torch.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from stalwart.config.fault_plan import CHAOS_KINDS, KINDS, Fault, FaultPlanError, parse_plan

# ---------------------------------------------------------------------- fired markers
def fired_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "ft" / "fired"


def fired_ids(run_dir: Path) -> set[str]:
    d = fired_dir(run_dir)
    return {p.stem for p in d.glob("*.json")} if d.is_dir() else set()


def mark_fired(run_dir: Path, fault: Fault, step: int, when: float, **extra) -> dict:
    """Durably record that ``fault`` fired (before it fires: a kill leaves no chance afterwards)."""
    d = fired_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    rec = {"id": fault.id, "kind": fault.kind, "rank": fault.rank, "step": step, "time": when,
           "spec": fault.describe(), **extra}
    tmp = d / f".{fault.id}.{os.getpid()}.tmp"
    with tmp.open("w") as fh:
        fh.write(json.dumps(rec))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, d / f"{fault.id}.json")
    return rec


def read_fired(run_dir: Path) -> list[dict]:
    d = fired_dir(run_dir)
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
