"""A training worker's replica group among the others (``fault.group_recovery``).

The job is ``R`` replica groups of ``S`` processes; each group is a job of its own (its own process
group, supervisor, run directory and restarts), and the groups meet only here: in the gradient
exchange of every step, over a cross group of every present rank that is rebuilt for each epoch of
the quorum (``runtime/quorum.py``; the lighthouse in ``launch/lighthouse.py`` decides the epochs).

:class:`ReplicaGroups` decides when it acts:

- ``begin``: a group started while others train skips its own restore and receives the state by a
  live transfer from a member (no disk read), checked by the state fingerprint; at a whole start every
  group restores what it has and the groups behind the newest take the transfer.
- each step's exchange (:class:`GroupExchange`, the step runner's accumulator): this rank's leaves
  of the canonical tree, plus its share of every absent group's (``parallel/regroup.py``), are
  exchanged with the other present ranks; the step commits only if every rank's exchange succeeded.
  If a group was lost, the ranks left compute its micro-batches of the same step and exchange again:
  the step's gradient, loss and data are the full job's, bit for bit.
- ``after_step``: a group admitted at this step boundary receives the state now.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import torch

from stalwart.parallel.elastic import GroupTree
from stalwart.parallel.regroup import assignment, own_leaves
from stalwart.runtime.quorum import ABORT, NEXT, QuorumClient, QuorumLost


class RejoinError(RuntimeError):
    """The state a group received does not match its source's."""


def _send_bytes(pg, data: bytes | bytearray | None, root: int = 0) -> bytes:
    """Broadcast ``data`` from ``root`` over ``pg`` (length first); every party returns the bytes."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    pg.broadcast(size, root).wait()
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else \
        torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        pg.broadcast(buf, root).wait()
    return buf.numpy().tobytes()


class GroupExchange:
    """The step runner's accumulator under ``fault.group_recovery`` (the interface of
    ``parallel.elastic.TreeAccumulator``: ``push`` each own leaf's value, ``total`` the root)."""

    def __init__(self, groups: "ReplicaGroups", leaves: int, compute: Callable[[int], torch.Tensor]) -> None:
        self.groups, self.leaves, self.compute = groups, leaves, compute
        self.own = own_leaves(leaves, groups.count, groups.size, groups.group, groups.rank)
        self.tree = GroupTree(leaves)
        self._next = self.own[0]

    def push(self, value: torch.Tensor) -> None:
        self.tree.push(self.own, self._next, value)
        self._next += 1

    def total(self, group=None) -> torch.Tensor:
        g = self.groups
        try:
            while True:
                assign = assignment(self.leaves, g.count, g.size, g.epoch["members"])
                mine = assign[(g.group, g.rank)]
                for iv in mine:  # an absent group's leaves: computed here, in this step
                    if not self.tree.have(iv):
                        self.tree.drop(iv)
                        for leaf in range(*iv):
                            self.tree.push(iv, leaf, self.compute(leaf))
                layout, width = GroupTree.layout(assign)
                mine_t = self.tree.mine(mine, width)
                gathered = torch.empty(len(layout) * width, mine_t.shape[1], dtype=mine_t.dtype)
                ok = g.all_gather(gathered, mine_t)
                decision = g.client.vote(g.epoch, g.step, ok)
                if decision == ABORT:
                    g.aborted()
                    continue
                if decision == NEXT:
                    g.pending = g.client.next_epoch(g.epoch["id"])
                return self.tree.root(gathered, assign)
        finally:
            self.tree = GroupTree(self.leaves)
            self._next = self.own[0]


class ReplicaGroups:
    def __init__(self, cfg, env, groups: int, leaves: int, checkpointer, fingerprinter, log_event, say) -> None:
        self.cfg, self.env = cfg, env
        self.count, self.size = groups, env.world_size
        self.group, self.rank = cfg.replica_group, env.rank
        self.leaves = leaves
        self.checkpointer, self.fingerprinter = checkpointer, fingerprinter
        self.log, self.say = log_event, say
        self.client = QuorumClient(cfg.lighthouse, self.group, self.size, self.rank, cfg.rejoin_timeout_s)
        self.epoch: dict = {}
        self.pending: dict | None = None
        self.pg = None
        self._abandoned: list = []  # process groups and work left behind by aborted exchanges
        self._abort_t: float | None = None

    # ------------------------------------------------------------------ joining
    def begin(self) -> None:
        """Restore this group's own state unless a live epoch will send it, register, enter the epoch."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        live = self._agreed(self.client.live() if self.rank == 0 else False)  # the group's ranks act alike
        step = -1
        if not live:
            self.checkpointer.restore()
            step = self.checkpointer.core.state.step
        self.client.register(attempt, step)
        epoch = self.client.admitted(attempt)
        if step < 0 and self.group in epoch["joiners"] and epoch["source"] is None:
            raise QuorumLost("this replica group skipped its restore to join a live epoch, which ended first")
        if step < 0 and self.group not in epoch["joiners"]:
            raise QuorumLost("this replica group skipped its restore but was admitted without a transfer")
        self._enter(epoch)

    def _agreed(self, flag: bool) -> bool:
        """Rank 0's ``flag``, on every rank of this group."""
        if self.size == 1:
            return flag
        import torch.distributed as dist

        box = torch.tensor([int(flag)], device=self.env.device)
        dist.broadcast(box, src=0)
        return bool(box.item())

    def after_step(self, step: int) -> None:
        """At the step boundary: enter the epoch a committed step took on (a group rejoins)."""
        if self.pending is not None:
            epoch, self.pending = self.pending, None
            self._enter(epoch)

    def _enter(self, epoch: dict) -> None:
        """Take part in ``epoch`` (the state sent first where it has joiners), or in a newer one if a member
        of it is lost before every rank arrived."""
        while True:
            self.epoch = epoch
            if epoch["source"] is not None and self.group in [epoch["source"], *epoch["joiners"]]:
                self._transfer(epoch)
            if self.client.arrive(epoch):
                break
            epoch = self.client.next_epoch(epoch["id"])
        self.pg = self.client.cross_group(epoch, self.cfg.collective_timeout_s)

    def _transfer(self, epoch: dict) -> None:
        """The source's state to the joiners, rank by rank, then the fingerprints compared."""
        source = self.group == epoch["source"]
        try:
            self._send_or_receive(epoch, source)
        except RuntimeError as e:  # a joiner lost on the way: its supervisor reports it; the source goes on
            if not source or isinstance(e, RejoinError):
                raise
            if self.rank == 0:
                self.log("group_transfer_failed", epoch=epoch["id"], joiners=epoch["joiners"],
                         error=str(e).splitlines()[0][:200])

    def _send_or_receive(self, epoch: dict, source: bool) -> None:
        t0 = time.perf_counter()
        pg = self.client.transfer_group(epoch, self.cfg.rejoin_timeout_s)
        blob = _send_bytes(pg, self.checkpointer.state_blob() if source else None)
        if not source:
            self.checkpointer.restore_blob(blob, f"replica group {epoch['source']}")
        _, parts, _, _ = self.fingerprinter.take(full=True)
        mine = json.dumps({k: parts.get(k) for k in ("params", "optim")}, sort_keys=True).encode()
        theirs = _send_bytes(pg, mine if source else None)
        seconds = time.perf_counter() - t0
        step = self.checkpointer.core.state.step
        if not source and theirs != mine:
            raise RejoinError(f"replica group {self.group}: the state received from group {epoch['source']} at "
                              f"step {step} has another fingerprint ({mine.decode()} != {theirs.decode()})")
        if self.rank == 0:
            self.log("group_transfer", role="source" if source else "joiner", epoch=epoch["id"], step=step,
                     source=epoch["source"], joiners=epoch["joiners"], bytes=len(blob), seconds=round(seconds, 4),
                     fingerprint_checked=True)
            if not source:  # what this group's session resumed from (goodput bounds its lost steps with it)
                self.log("resumed", step=step, source="peer", path=f"replica group {epoch['source']}")
                self.say(f"replica group {self.group}: rejoined at step {step} from group {epoch['source']}'s memory "
                         f"({len(blob) / 2**20:.1f} MiB in {seconds:.2f} s, fingerprint checked)")

    @property
    def step(self) -> int:
        """The step being trained."""
        return self.checkpointer.core.state.step + 1

    # ------------------------------------------------------------------ the exchange
    def exchange(self, compute: Callable[[int], torch.Tensor]) -> GroupExchange:
        return GroupExchange(self, self.leaves, compute)

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor) -> bool:
        """``mine`` from every present rank into ``out`` over the epoch's cross group; False if a peer is
        gone, or if the step was aborted meanwhile (a rank whose ring neighbour died may wait on a live
        neighbour that already left the collective: it is abandoned, never waited out)."""
        work = self.pg._allgather_base(out, mine)
        try:
            if self.client.wait_or_abort(work, self.epoch, self.step):
                return True
            self._abandoned.append((self.pg, work, out))  # its thread ends at the group's timeout
            return False
        except RuntimeError as e:
            if self.rank == 0:
                print(f"stalwart train: replica group {self.group}: step {self.step}: the exchange failed "
                      f"({str(e).splitlines()[0][:160]}); waiting for the quorum", file=sys.stderr, flush=True)
            return False

    def aborted(self) -> None:
        """The step was aborted (a group was lost): enter the next epoch and redo it."""
        t0 = time.perf_counter()
        before = self.epoch
        self._enter(self.client.next_epoch(before["id"]))
        if self.rank == 0:
            lost = sorted(set(before["members"]) - set(self.epoch["members"]))
            self.log("group_step_redone", step=self.step, epoch=self.epoch["id"], lost=lost,
                     members=self.epoch["members"], wait_s=round(time.perf_counter() - t0, 4))
