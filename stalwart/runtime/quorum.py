"""The replica groups' quorum store: its keys, and a worker's side of it (``fault.group_recovery``).

One ``TCPStore`` (the lighthouse's, served by the launcher: loopback on one host, the address given
across hosts) holds, under the prefix ``q/``:

- ``e<E>``            epoch ``E`` as JSON: ``members`` (the groups that train in it), ``source`` and
                      ``joiners`` (a group whose state is sent to the joiners when they enter), ``reason``
- ``e<E>/s<S>/ok``    how many ranks of epoch ``E`` finished step ``S``'s exchange (an ``add`` counter)
- ``e<E>/s<S>/d``     the step's decision, written once (``compare_set``): ``commit``, ``next`` (commit,
                      and epoch ``E + 1``, the lighthouse's proposal, begins after this step) or ``abort``
- ``e<E>/next``       the lighthouse's proposal for epoch ``E + 1`` (a group rejoins); ``taken`` by the
                      rank that decides a step, or ``withdrawn`` by the lighthouse when a group fails first
- ``e<E>/broken``     set by the lighthouse when a member of epoch ``E`` failed: a step waiting for its
                      votes is aborted
- ``join/<g>``        a group's registration (JSON: ``attempt``, ``step`` it restored, -1 = none)
- ``ack/<g>``         the epoch a registered group is admitted to (JSON: ``epoch``, ``attempt``)
- ``e<E>/arrived``    how many ranks entered epoch ``E`` (its process group is built once all have)
- ``failure/<g>``     group ``g``'s newest failure as its supervisor saw it (JSON: ``kind``, ``rank``, ``time``)
- ``failed/<g>``      failures of group ``g`` seen by its supervisor (an ``add`` counter)
- ``gone/<g>``        group ``g``'s launcher ended: no start waits for it
- ``live``            1 while some epoch trains (a restarted group then skips its own restore)

A step commits only when every rank of its epoch finished the exchange; a rank that saw the exchange
fail, or a failed member, aborts it, and the ranks left redo it in the next epoch. Values are JSON or
plain words: nothing is unpickled.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch.distributed as dist

from stalwart.errors import UserError

PREFIX = "q"
COMMIT, NEXT, ABORT = "commit", "next", "abort"
TAKEN, WITHDRAWN = "taken", "withdrawn"


class QuorumLost(RuntimeError):
    """The quorum store cannot be reached, or no epoch admitted this group in time."""


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"fault.lighthouse must be HOST:PORT, not {addr!r}")
    return host, int(port)


def open_store(addr: str, timeout_s: float, is_master: bool = False):
    """The quorum store at ``addr`` (a client), or served here (``is_master``: the launcher)."""
    from stalwart.runtime.group import bound_tcp_store

    host, port = parse_addr(addr)
    store = bound_tcp_store(host, port, None, is_master, timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, dist.PrefixStore(PREFIX, store)


def read_json(store, key: str) -> dict | None:
    if not store.check([key]):
        return None
    return json.loads(store.get(key))


def text(store, key: str) -> str:
    return store.get(key).decode() if store.check([key]) else ""


def poll(until, timeout_s: float, what: str, first: float = 0.0005, most: float = 0.01):
    """Call ``until()`` until it returns something other than None, sleeping between calls (from
    ``first`` up to ``most`` seconds); QuorumLost after ``timeout_s``."""
    deadline, wait = time.monotonic() + timeout_s, first
    while True:
        got = until()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise QuorumLost(f"{what}: nothing after {timeout_s:.0f} s")
        time.sleep(wait)
        wait = min(most, wait * 2)


class QuorumClient:
    """One rank's side of the quorum: register, wait for an epoch, vote on each step."""

    def __init__(self, addr: str, group: int, size: int, rank: int, timeout_s: float, store=None) -> None:
        """``store``: the quorum's (prefixed) store itself, instead of connecting to ``addr``."""
        self.group, self.size, self.rank, self.timeout_s = group, size, rank, timeout_s
        self.store = store if store is not None else open_store(addr, timeout_s)[1]
        self.waiting = lambda waiting: None  # told while this rank waits on the others (its heartbeat)

    def _poll(self, until, what: str, **kwargs):
        self.waiting(True)
        try:
            return poll(until, self.timeout_s, what, **kwargs)
        finally:
            self.waiting(False)

    def live(self) -> bool:
        return text(self.store, "live") == "1"

    def register(self, attempt: int, step: int) -> None:
        """This group asks to train (rank 0 of the group registers it)."""
        if self.rank == 0:
            self.store.set(f"join/{self.group}", json.dumps({"attempt": attempt, "step": step}))

    def admitted(self, attempt: int) -> dict:
        """The epoch this group's ``attempt`` is admitted to, once it is in force (blocks up to the timeout)."""
        def ready():
            ack = read_json(self.store, f"ack/{self.group}")
            if ack is None or ack["attempt"] != attempt:
                return None
            epoch = read_json(self.store, f"e{ack['epoch']}")
            return epoch if epoch is not None and self.group in epoch["members"] else None
        return self._poll(ready, f"replica group {self.group} waiting to be admitted", most=0.05)

    def next_epoch(self, current: int) -> dict:
        """Epoch ``current + 1`` once the lighthouse (or the rank that took a proposal) wrote it."""
        return self._poll(lambda: read_json(self.store, f"e{current + 1}"),
                          f"replica group {self.group} waiting for epoch {current + 1}", most=0.02)

    def arrive(self, epoch: dict) -> bool:
        """Wait until every rank of ``epoch`` is here (before its process group is built, which would
        block on an absent member): True, or False when the epoch broke or a newer one exists first."""
        e, total = epoch["id"], len(epoch["members"]) * self.size
        self.store.add(f"e{e}/arrived", 1)

        def ready():
            if self.store.add(f"e{e}/arrived", 0) >= total:
                return True
            if self.store.check([f"e{e}/broken"]) or self.store.check([f"e{e + 1}"]):
                return False
            return None
        return self._poll(ready, f"the ranks of epoch {e}", most=0.02)

    def cross_group(self, epoch: dict, timeout_s: float):
        """The process group of every rank of ``epoch``'s members (group order, then rank), on the host's
        backend, under the epoch's own key prefix."""
        members = sorted(epoch["members"])
        me = members.index(self.group) * self.size + self.rank
        return _gloo(dist.PrefixStore(f"e{epoch['id']}/pg", self.store), me, len(members) * self.size, timeout_s)

    def transfer_group(self, epoch: dict, timeout_s: float):
        """Rank ``rank`` of the source and of every joiner of ``epoch``: the source is rank 0."""
        parties = [epoch["source"], *sorted(epoch["joiners"])]
        return _gloo(dist.PrefixStore(f"e{epoch['id']}/xfer/{self.rank}", self.store), parties.index(self.group),
                     len(parties), timeout_s)

    def wait_or_abort(self, work, epoch: dict, step: int) -> bool:
        """Wait for ``work`` (a collective of ``epoch``'s group for ``step``): True when it completed (its
        error raised here), False when the step was aborted or the epoch broke first."""
        e = epoch["id"]
        decided, broken = f"e{e}/s{step}/d", f"e{e}/broken"

        def done():
            if work.is_completed():
                work.wait()
                return True
            if self.store.check([broken]) or (self.store.check([decided]) and
                                              self.store.get(decided).decode() == ABORT):
                return False
            return None
        return self._poll(done, f"the exchange of step {step}", first=0.0002, most=0.005)

    def vote(self, epoch: dict, step: int, ok: bool) -> str:
        """This rank's outcome of ``step``'s exchange; returns the step's decision (all ranks get the same)."""
        e = epoch["id"]
        key, decided = f"e{e}/s{step}/ok", f"e{e}/s{step}/d"
        if not ok:
            self.store.compare_set(decided, "", ABORT)
        elif self.store.add(key, 1) == len(epoch["members"]) * self.size:
            self.store.compare_set(decided, "", NEXT if self._take_proposal(e) else COMMIT)

        def outcome():
            if self.store.check([decided]):
                return self.store.get(decided).decode()
            if self.store.check([f"e{e}/broken"]):
                self.store.compare_set(decided, "", ABORT)
            return None
        decision = self._poll(outcome, f"the decision on step {step}")
        if self.rank == 0 and self.group == min(epoch["members"]):  # every rank is past step - 2's keys
            for key in (f"e{e}/s{step - 2}/ok", f"e{e}/s{step - 2}/d"):
                self.store.delete_key(key)
        return decision

    def _take_proposal(self, e: int) -> bool:
        """Take the lighthouse's proposal for epoch ``e + 1``, if there is one: it begins after this step."""
        proposal = text(self.store, f"e{e}/next")
        if proposal in ("", TAKEN, WITHDRAWN):
            return False
        if self.store.compare_set(f"e{e}/next", proposal, TAKEN).decode() != TAKEN:
            return False  # withdrawn meanwhile
        self.store.set(f"e{e + 1}", proposal)
        return True


def _gloo(store, rank: int, size: int, timeout_s: float):
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
