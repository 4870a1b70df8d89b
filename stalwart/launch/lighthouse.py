"""The lighthouse: which replica groups train together, epoch by epoch (``fault.group_recovery``).

It runs in the launcher, on a thread that calls :meth:`Lighthouse.tick` every few milliseconds, and
keeps only membership: the steps themselves are committed by the workers through the quorum store
(``runtime/quorum.py``, where the keys are listed). What it decides:

- **Start** (and after every group was lost at once): wait until every group has registered with the
  step it restored (at most ``fault.rejoin_timeout_s`` after the first), then open an epoch of them;
  the group with the newest state (lowest index among equals) is the source, and the groups behind it
  join by a live transfer.
- **A group fails** (its supervisor counts it in ``failed/<g>``): a pending proposal is withdrawn, the
  epoch is marked broken (a step waiting for the lost group's vote aborts), and the next epoch is the
  members left: the survivors redo the step with the lost group's micro-batches. If no member is left,
  the job falls back to a whole start (the groups restart from their own snapshots or checkpoints).
- **A group comes back** (registers while an epoch trains): propose the next epoch with it as a joiner
  and the lowest member as its source; the rank that decides the next step takes the proposal, and the
  state is sent at that step boundary.
"""

from __future__ import annotations

import json
import threading

from stalwart.runtime.quorum import TAKEN, WITHDRAWN, read_json, text


class Lighthouse:
    def __init__(self, store, groups: int, rejoin_timeout_s: float, log_event) -> None:
        self.store, self.groups, self.rejoin_timeout_s = store, groups, rejoin_timeout_s
        self.log = log_event
        self.epoch = 0                 # the newest epoch written
        self.members: list[int] = []   # of that epoch; [] while none trains
        self.proposal: dict | None = None
        self.failures = [0] * groups   # failed/<g> counters seen
        self.registered: dict[int, dict] = {}
        self.first_registration: float | None = None
        self.lost_at: dict[int, float] = {}  # group -> when it was lost (for the rejoin's event)
        self.whole_starts = 0

    # ------------------------------------------------------------------ the tick
    def tick(self, now: float) -> None:
        self._read_failures(now)
        self._read_registrations(now)
        self._settle_proposal(now)
        if not self.members:
            self._maybe_start(now)
        elif self.proposal is None:
            self._maybe_propose(now)

    def _read_failures(self, now: float) -> None:
        for g in range(self.groups):
            n = self.store.add(f"failed/{g}", 0)
            if n > self.failures[g]:
                self.failures[g] = n
                self._lost(g, now)

    def _read_registrations(self, now: float) -> None:
        for g in range(self.groups):
            reg = read_json(self.store, f"join/{g}")
            if reg is None:
                continue
            self.store.delete_key(f"join/{g}")
            self.registered[g] = reg
            if self.first_registration is None:
                self.first_registration = now

    # ------------------------------------------------------------------ decisions
    def _lost(self, g: int, now: float) -> None:
        self.registered.pop(g, None)
        self._withdraw(now)
        if g not in self.members:
            return
        self.store.set(f"e{self.epoch}/broken", "1")
        left = [m for m in self.members if m != g]
        self.lost_at[g] = now
        cause = read_json(self.store, f"failure/{g}") or {}
        self.log("group_lost", group=g, epoch=self.epoch, survivors=left, cause=cause.get("kind"),
                 rank=cause.get("rank"), exitcode=cause.get("exitcode"),
                 lighthouse_s=round(now - cause["time"], 4) if "time" in cause else None)
        if left:
            self._open(left, None, [], "group_lost", now, lost=g)
            return
        self.members = []
        self.store.set("live", "0")
        self.whole_starts += 1
        self.first_registration = None
        self.log("group_whole_job_fallback", group=g, epoch=self.epoch,
                 reason="every replica group is lost: each restarts from its own snapshot or checkpoint")

    def _withdraw(self, now: float) -> None:
        if self.proposal is None:
            return
        key = f"e{self.epoch}/next"
        got = self.store.compare_set(key, json.dumps(self.proposal), WITHDRAWN).decode()
        if got == TAKEN:
            self._adopted(now)
        else:
            self.proposal = None

    def _settle_proposal(self, now: float) -> None:
        if self.proposal is not None and text(self.store, f"e{self.epoch}/next") == TAKEN:
            self._adopted(now)

    def _adopted(self, now: float) -> None:
        p, self.proposal = self.proposal, None
        self.epoch, self.members = p["id"], p["members"]
        for g in p["joiners"]:
            self.log("group_rejoined", group=g, epoch=p["id"], source=p["source"],
                     away_s=round(now - self.lost_at.pop(g, now), 3))

    def _maybe_start(self, now: float) -> None:
        if not self.registered:
            return
        expected = {g for g in range(self.groups) if not self.store.check([f"gone/{g}"])}
        everyone = expected <= set(self.registered)
        if not everyone and now - (self.first_registration or now) < self.rejoin_timeout_s:
            return
        steps = {g: int(r["step"]) for g, r in self.registered.items()}
        newest = max(steps.values())
        source = min(g for g, s in steps.items() if s == newest)
        behind = sorted(g for g, s in steps.items() if s < newest)
        missing = sorted(set(range(self.groups)) - set(steps))
        self._open(sorted(steps), source if behind else None, behind, "start", now, step=newest, missing=missing)
        self.store.set("live", "1")

    def _maybe_propose(self, now: float) -> None:
        joiners = sorted(g for g in self.registered if g not in self.members)
        if not joiners:
            return
        acks = {g: self.registered.pop(g)["attempt"] for g in joiners}
        self.proposal = {"id": self.epoch + 1, "members": sorted(self.members + joiners),
                         "source": min(self.members), "joiners": joiners, "reason": "rejoin"}
        for g, attempt in acks.items():
            self.store.set(f"ack/{g}", json.dumps({"epoch": self.epoch + 1, "attempt": attempt}))
        self.store.set(f"e{self.epoch}/next", json.dumps(self.proposal))

    def _open(self, members: list[int], source: int | None, joiners: list[int], reason: str, now: float,
              **info) -> None:
        self.epoch += 1
        epoch = {"id": self.epoch, "members": members, "source": source, "joiners": joiners, "reason": reason}
        self.store.set(f"e{self.epoch}", json.dumps(epoch))
        for g in members:
            reg = self.registered.pop(g, None)
            if reg is not None:
                self.store.set(f"ack/{g}", json.dumps({"epoch": self.epoch, "attempt": reg["attempt"]}))
        self.members = members
        self.log("group_epoch", epoch=self.epoch, members=members, source=source, joiners=joiners, reason=reason,
                 **info)


class LighthouseThread:
    """:class:`Lighthouse` ticking on a daemon thread until ``stop``."""

    def __init__(self, lighthouse: Lighthouse, interval_s: float = 0.01) -> None:
        self.lighthouse, self.interval_s = lighthouse, interval_s
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="lighthouse", daemon=True)

    def _run(self) -> None:
        import time

        try:
            while not self._stop.wait(self.interval_s):
                self.lighthouse.tick(time.time())
        except BaseException as e:  # noqa: BLE001 - reported by the launcher
            self.error = e

    def __enter__(self) -> "LighthouseThread":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
