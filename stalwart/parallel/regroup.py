"""A step's micro-batches over the replica groups that are present (``fault.group_recovery``).

The job is ``R`` replica groups of ``S`` ranks, each rank a full replica of the model. Of the ``L``
micro-batches of a step, virtual data-parallel rank ``v = g * S + s`` (group ``g``, rank ``s`` in it)
always owns the leaves ``[v L / (R S), (v + 1) L / (R S))`` of the canonical gradient tree
(``parallel/elastic.py``). While a group is absent its leaves are shared out, contiguously and in
order, over the ranks of the groups that are present, so every leaf of every step is computed by
exactly one present rank. The tree's additions do not depend on who computed a leaf, so the step's
gradient is bit for bit the one of the full job: a lost group's work is redone in the same step, and
the steps it misses keep the global batch.

``parallel.elastic.GroupTree`` is one rank's part of a step: the leaves it computed, summed into
their aligned blocks as they arrive, and the root from every present rank's blocks. Nothing here
imports torch: the launcher checks a group layout before torch loads.
"""

from __future__ import annotations

from stalwart.errors import UserError

Interval = tuple[int, int]  # leaves [lo, hi)


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
