"""A step's micro-batches over the replica groups that are present (``fault.group_recovery``).

The job is ``R`` replica groups of ``S`` ranks, each rank a full replica of the model. Of the ``L``
micro-batches of a step, virtual data-parallel rank ``v = g * S + s`` (group ``g``, rank ``s`` in it)
always owns the leaves ``[v L / (R S), (v + 1) L / (R S))`` of the canonical gradient tree
(``parallel/elastic.py``). While a group is absent its leaves are shared out, contiguously and in
order, over the ranks of the groups that are present, so every leaf of every step is computed by
exactly one present rank. The tree's additions do not depend on who computed a leaf, so the step's
gradient is bit for bit the one of the full job: a lost group's work is redone in the same step, and
the steps it misses keep the global batch.

:class:`GroupTree` is one rank's part of a step: the leaves it computed, summed into their aligned
blocks as they arrive, and the exchange of every present rank's blocks (one all-gather over the cross
group) that yields the root on every rank.
"""

from __future__ import annotations

import torch

from stalwart.errors import UserError
from stalwart.parallel.elastic import blocks, tree_sum

Interval = tuple[int, int]


def own_leaves(leaves: int, groups: int, size: int, group: int, rank: int) -> Interval:
    """The leaves rank ``rank`` of group ``group`` owns when every group is present."""
    per = leaves // (groups * size)
    v = group * size + rank
    return v * per, (v + 1) * per


def split(lo: int, hi: int, parts: int) -> list[Interval]:
    """``[lo, hi)`` cut into ``parts`` contiguous pieces, as even as integers allow (earlier pieces larger)."""
    n = hi - lo
    out, at = [], lo
    for i in range(parts):
        take = n // parts + (1 if i < n % parts else 0)
        out.append((at, at + take))
        at += take
    return out


def assignment(leaves: int, groups: int, size: int, present: list[int]) -> dict[tuple[int, int], list[Interval]]:
    """(group, rank) of every present rank -> the leaf intervals it computes this step, in leaf order:
    its own, then its share of each absent group's (each absent group's leaves split evenly over the
    present ranks in order)."""
    present = sorted(present)
    ranks = [(g, s) for g in present for s in range(size)]
    out: dict[tuple[int, int], list[Interval]] = {r: [own_leaves(leaves, groups, size, *r)] for r in ranks}
    for g in range(groups):
        if g in present:
            continue
        lo, _ = own_leaves(leaves, groups, size, g, 0)
        _, hi = own_leaves(leaves, groups, size, g, size - 1)
        for r, piece in zip(ranks, split(lo, hi, len(ranks))):
            if piece[0] < piece[1]:
                out[r].append(piece)
    return {r: sorted(v) for r, v in out.items()}


def inner_parallelism(cfg, size: int):
    """The layout inside one replica group of ``size`` processes: each a whole replica of the model
    (``cfg``: the job's parallelism section)."""
    from dataclasses import replace

    return replace(cfg, dp_replicate=size, dp_shard=1)


def check_groups(leaves: int, groups: int, size: int) -> None:
    """The job's leaves must split evenly over all its ranks when every group is present."""
    if leaves % (groups * size):
        raise UserError(f"fault.group_recovery: the {leaves} micro-batches of a step (training.global_batch / "
                        f"training.micro_batch) must split evenly over the {groups * size} processes of the "
                        f"{groups} replica groups")


class GroupTree:
    """One rank's leaves of one step summed into blocks of the canonical tree, for any set of intervals.

    ``push(leaf, value)`` adds the value of one leaf; the leaves of each interval arrive in order.
    ``layout(assign)`` lists every present rank's blocks; ``root(gathered, assign)`` finishes the tree
    from the all-gathered blocks."""

    def __init__(self, leaves: int) -> None:
        self.leaves = leaves
        self.nodes: dict[Interval, torch.Tensor] = {}  # finished blocks
        self._open: dict[Interval, list[tuple[int, int, torch.Tensor]]] = {}  # interval -> stack

    def push(self, interval: Interval, leaf: int, value: torch.Tensor) -> None:
        mine = blocks(*interval)
        stack = self._open.setdefault(interval, [])
        stack.append((leaf, 1, value))
        while len(stack) >= 2:
            (lo1, s1, a), (lo2, s2, b) = stack[-2], stack[-1]
            if s1 != s2 or lo2 != lo1 + s1 or lo1 % (2 * s1) or not any(
                    b_lo <= lo1 and lo1 + 2 * s1 <= b_lo + b_size for b_lo, b_size in mine):
                break
            stack[-2:] = [(lo1, 2 * s1, a + b)]
        if stack and (stack[-1][0], stack[-1][1]) in mine:
            lo, size, v = stack.pop()
            self.nodes[(lo, size)] = v

    def have(self, interval: Interval) -> bool:
        """Whether every block of ``interval`` is summed here."""
        return all(b in self.nodes for b in blocks(*interval))

    def drop(self, interval: Interval) -> None:
        """Forget what was summed of ``interval`` (its leaves are computed again)."""
        self._open.pop(interval, None)
        for b in blocks(*interval):
            self.nodes.pop(b, None)

    @staticmethod
    def layout(assign: dict[tuple[int, int], list[Interval]]) -> tuple[list[list[Interval]], int]:
        """Every present rank's blocks in the cross group's rank order, and the most any rank has."""
        per_rank = [[b for iv in assign[r] for b in blocks(*iv)] for r in sorted(assign)]
        return per_rank, max(len(b) for b in per_rank)

    def mine(self, intervals: list[Interval], width: int) -> torch.Tensor:
        """This rank's blocks of ``intervals`` stacked ``(width, n)``, zero rows after them."""
        own = [self.nodes[b] for iv in intervals for b in blocks(*iv)]
        out = torch.zeros(width, own[0].numel(), dtype=own[0].dtype, device=own[0].device)
        for i, v in enumerate(own):
            out[i] = v
        return out

    def root(self, gathered: torch.Tensor, assign: dict[tuple[int, int], list[Interval]]) -> torch.Tensor:
        """The tree's root from ``gathered`` (``(ranks * width, n)``, the all-gather of every rank's
        :meth:`mine`)."""
        layout, width = self.layout(assign)
        nodes = {blk: gathered[r * width + i] for r, rank_blocks in enumerate(layout) for i, blk in enumerate(rank_blocks)}
        return tree_sum(self.leaves, nodes)
