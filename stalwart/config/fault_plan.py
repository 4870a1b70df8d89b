"""The grammar of ``fault.inject``: a fault-injection plan parsed into typed faults (pure; no I/O).

A plan is a ``;``-separated list of faults, each ``KIND:key=value,key=value``::

    kill:rank=1,step=17;hang:rank=0,step=30;nan:step=40;slow:rank=1,factor=3,steps=50-80;
    exception:rank=0,step=60;corrupt_checkpoint:step=50

It lives in the config layer because the config validates the plan when it is loaded (a bad plan is a
one-line error before any process starts); ``stalwart.ft.plan`` records which faults fired and draws
chaos schedules.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.errors import UserError

KINDS = ("kill", "hang", "exception", "nan", "slow", "corrupt_checkpoint")
# Faults that need a step; `slow` takes a range instead.
_KEYS = {
    "kill": {"rank", "step", "once"},
    "hang": {"rank", "step", "once"},
    "exception": {"rank", "step", "once"},
    "nan": {"rank", "step", "once"},
    "slow": {"rank", "factor", "steps"},
    "corrupt_checkpoint": {"step"},
}
CHAOS_KINDS = ("kill", "hang", "exception")


class FaultPlanError(UserError, ValueError):
    """A malformed ``--fault.inject`` plan; the message names the bad item."""


@dataclass(frozen=True)
class Fault:
    kind: str
    index: int            # position in the plan: the fault's identity across restarts
    rank: int = 0
    step: int = 0         # fires while running this step (1-based); corrupt_checkpoint: checkpoint step-N
    first: int = 0        # slow: step range [first, last]
    last: int = 0
    factor: float = 1.0   # slow: the step's compute takes factor x as long
    once: bool = True

    @property
    def id(self) -> str:
        return f"{self.index}-{self.kind}"

    def describe(self) -> str:
        if self.kind == "slow":
            return f"slow:rank={self.rank},factor={self.factor:g},steps={self.first}-{self.last}"
        if self.kind == "corrupt_checkpoint":
            return f"corrupt_checkpoint:step={self.step}"
        return f"{self.kind}:rank={self.rank},step={self.step}" + ("" if self.once else ",once=0")


def _int(item: str, key: str, value: str, lo: int = 0) -> int:
    try:
        n = int(value)
    except ValueError:
        raise FaultPlanError(f"fault.inject: '{item}': {key}={value!r} is not an integer") from None
    if n < lo:
        raise FaultPlanError(f"fault.inject: '{item}': {key} must be >= {lo}, got {n}")
    return n


def parse_plan(text: str) -> list[Fault]:
    """Parse a plan string into typed faults; raise FaultPlanError naming the bad item."""
    faults: list[Fault] = []
    for index, item in enumerate(x.strip() for x in text.split(";")):
        if not item:
            continue
        kind, _, rest = item.partition(":")
        kind = kind.strip()
        if kind not in KINDS:
            import difflib

            guess = difflib.get_close_matches(kind, KINDS, n=1)
            hint = f" (did you mean '{guess[0]}'?)" if guess else ""
            raise FaultPlanError(f"fault.inject: unknown fault kind '{kind}' in '{item}'{hint}; "
                                 f"kinds: {', '.join(KINDS)}")
        kv: dict[str, str] = {}
        for part in (p.strip() for p in rest.split(",")):
            if not part:
                continue
            key, eq, value = part.partition("=")
            if not eq or not value.strip():
                raise FaultPlanError(f"fault.inject: '{item}': expected key=value, got '{part}'")
            key = key.strip()
            if key not in _KEYS[kind]:
                raise FaultPlanError(f"fault.inject: '{item}': '{kind}' takes {', '.join(sorted(_KEYS[kind]))}, "
                                     f"not '{key}'")
            kv[key] = value.strip()
        rank = _int(item, "rank", kv.get("rank", "0"))
        once = kv.get("once", "1") not in ("0", "false", "no")
        if kind == "slow":
            if "steps" not in kv or "factor" not in kv:
                raise FaultPlanError(f"fault.inject: '{item}': slow needs factor=F and steps=A-B")
            a, dash, b = kv["steps"].partition("-")
            first = _int(item, "steps", a, 1)
            last = _int(item, "steps", b, 1) if dash else first
            if last < first:
                raise FaultPlanError(f"fault.inject: '{item}': steps range {first}-{last} is empty")
            try:
                factor = float(kv["factor"])
            except ValueError:
                raise FaultPlanError(f"fault.inject: '{item}': factor={kv['factor']!r} is not a number") from None
            if factor < 1:
                raise FaultPlanError(f"fault.inject: '{item}': factor must be >= 1, got {factor:g}")
            faults.append(Fault(kind, index, rank=rank, first=first, last=last, factor=factor))
            continue
        if "step" not in kv:
            raise FaultPlanError(f"fault.inject: '{item}': {kind} needs step=N")
        faults.append(Fault(kind, index, rank=rank, step=_int(item, "step", kv["step"], 1), once=once))
    return faults
