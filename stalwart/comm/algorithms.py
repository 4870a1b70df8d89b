"""Flat collective algorithms over point-to-point messages (any team size, any buffer length).

Every function works in place on a flat, contiguous 1-D ``buf`` and a :class:`Team`; ``op`` is 'sum'
or 'max' (AVG is a sum divided once by the caller). Costs in the alpha-beta-gamma model, for p ranks
and n bytes, are in :mod:`stalwart.comm.cost`; the comments give the step structure they count.
"""

from __future__ import annotations

import torch

from stalwart.comm.team import (
    Bounds,
    Team,
    chunk_bounds,
    combine,
    merge_bounds,
    wait_all,
)


def _seg(buf: torch.Tensor, b: tuple[int, int]) -> torch.Tensor:
    return buf[b[0]:b[0] + b[1]]


# ------------------------------------------------------------------------------------------------
# Ring: p-1 steps each way, every rank sends one segment to its right neighbour per step.
# ------------------------------------------------------------------------------------------------

def ring_reduce_scatter(team: Team, buf: torch.Tensor, bounds: Bounds, op: str) -> None:
    """After this, member i's segment ``bounds[i]`` of ``buf`` holds the reduction over the team."""
    p, i = team.size, team.index
    if p == 1:
        return
    right, left = (i + 1) % p, (i - 1) % p
    scratch = torch.empty(max(b[1] for b in bounds), dtype=buf.dtype)
    for s in range(p - 1):
        send_c, recv_c = (i - s - 1) % p, (i - s - 2) % p
        tmp = scratch[:bounds[recv_c][1]]
        team.exchange([(_seg(buf, bounds[send_c]), right)], [(tmp, left)])
        combine(_seg(buf, bounds[recv_c]), tmp, op)


def ring_all_gather(team: Team, buf: torch.Tensor, bounds: Bounds) -> None:
    """Member i contributes ``bounds[i]`` of ``buf``; afterwards every member holds all segments."""
    p, i = team.size, team.index
    if p == 1:
        return
    right, left = (i + 1) % p, (i - 1) % p
    for s in range(p - 1):
        send_c, recv_c = (i - s) % p, (i - s - 1) % p
        team.exchange([(_seg(buf, bounds[send_c]), right)], [(_seg(buf, bounds[recv_c]), left)])


def ring_all_reduce(team: Team, buf: torch.Tensor, op: str) -> None:
    bounds = chunk_bounds(buf.numel(), team.size)
    ring_reduce_scatter(team, buf, bounds, op)
    ring_all_gather(team, buf, bounds)


# ------------------------------------------------------------------------------------------------
# Power-of-two folding: with p = 2^k + rem, the first 2*rem members pair up (even -> odd) so that
# 2^k "active" members remain; the idle even members get the result back at the end.
# ------------------------------------------------------------------------------------------------

def _fold_plan(p: int) -> tuple[int, list[int]]:
    """(rem, active member indices in order) for folding p members onto a power of two."""
    q = 1 << (p.bit_length() - 1)
    rem = p - q
    return rem, [2 * j + 1 for j in range(rem)] + list(range(2 * rem, p))


def _fold_in(team: Team, buf: torch.Tensor, op: str, rem: int) -> None:
    i = team.index
    if i < 2 * rem:
        if i % 2 == 0:
            team.exchange([(buf, i + 1)], [])
        else:
            tmp = torch.empty_like(buf)
            team.exchange([], [(tmp, i - 1)])
            combine(buf, tmp, op)


def _fold_out(team: Team, buf: torch.Tensor, rem: int) -> None:
    i = team.index
    if i < 2 * rem:
        if i % 2 == 0:
            team.exchange([], [(buf, i + 1)])
        else:
            team.exchange([(buf, i - 1)], [])


def _halving(team: Team, buf: torch.Tensor, blocks: Bounds, op: str) -> None:
    """Recursive halving reduce-scatter on a power-of-two team: member j ends with block j reduced."""
    q, i = team.size, team.index
    lo, hi, mask = 0, q, q // 2
    scratch = None
    while mask >= 1:
        mid = (lo + hi) // 2
        partner = i ^ mask
        keep, give = ((mid, hi), (lo, mid)) if i & mask else ((lo, mid), (mid, hi))
        k_off, k_end = blocks[keep[0]][0], blocks[keep[1] - 1][0] + blocks[keep[1] - 1][1]
        g_off, g_end = blocks[give[0]][0], blocks[give[1] - 1][0] + blocks[give[1] - 1][1]
        if scratch is None:  # the first kept range is the largest: later ones are inside it
            scratch = torch.empty(k_end - k_off, dtype=buf.dtype)
        tmp = scratch[:k_end - k_off]
        team.exchange([(buf[g_off:g_end], partner)], [(tmp, partner)])
        combine(buf[k_off:k_end], tmp, op)
        lo, hi = keep
        mask //= 2


def _doubling_gather(team: Team, buf: torch.Tensor, blocks: Bounds) -> None:
    """Recursive doubling all-gather on a power-of-two team: member j starts with block j."""
    q, i = team.size, team.index
    lo, hi, mask = i, i + 1, 1
    while mask < q:
        partner = i ^ mask
        plo, phi = (lo - mask, lo) if i & mask else (hi, hi + mask)
        mine = buf[blocks[lo][0]:blocks[hi - 1][0] + blocks[hi - 1][1]]
        theirs = buf[blocks[plo][0]:blocks[phi - 1][0] + blocks[phi - 1][1]]
        team.exchange([(mine, partner)], [(theirs, partner)])
        lo, hi = min(lo, plo), max(hi, phi)
        mask *= 2


def _on_power_of_two(team: Team, buf: torch.Tensor, op: str, body) -> None:
    """Fold the extra ranks of a non-power-of-two team in, run ``body(sub_team)`` on the power-of-two
    part, and send the result back out to the folded ranks."""
    if team.size == 1:
        return
    rem, active = _fold_plan(team.size)
    _fold_in(team, buf, op, rem)
    if team.index in active:
        body(team.sub([team.members[a] for a in active]))
    _fold_out(team, buf, rem)


def recursive_doubling_all_reduce(team: Team, buf: torch.Tensor, op: str) -> None:
    """log2(p) steps (+2 when p is not a power of two), each exchanging the whole buffer."""
    def body(sub: Team) -> None:
        tmp = torch.empty_like(buf)
        mask = 1
        while mask < sub.size:
            sub.exchange([(buf, sub.index ^ mask)], [(tmp, sub.index ^ mask)])
            combine(buf, tmp, op)
            mask *= 2

    _on_power_of_two(team, buf, op, body)


def rabenseifner_all_reduce(team: Team, buf: torch.Tensor, op: str) -> None:
    """Recursive halving reduce-scatter then recursive doubling all-gather (Rabenseifner)."""
    def body(sub: Team) -> None:
        blocks = chunk_bounds(buf.numel(), sub.size)
        _halving(sub, buf, blocks, op)
        _doubling_gather(sub, buf, blocks)

    _on_power_of_two(team, buf, op, body)


def _active_blocks(bounds: Bounds, rem: int, p: int) -> Bounds:
    """Blocks for the active members of a fold: active j < rem owns segments 2j and 2j+1."""
    groups = [[2 * j, 2 * j + 1] for j in range(rem)] + [[k] for k in range(2 * rem, p)]
    return merge_bounds(bounds, groups)


def halving_reduce_scatter(team: Team, buf: torch.Tensor, bounds: Bounds, op: str) -> None:
    """Recursive halving reduce-scatter for any p: member i ends with ``bounds[i]`` reduced."""
    p, i = team.size, team.index
    if p == 1:
        return
    rem, active = _fold_plan(p)
    _fold_in(team, buf, op, rem)
    if i in active:
        sub = team.sub([team.members[a] for a in active])
        _halving(sub, buf, _active_blocks(bounds, rem, p), op)
    if i < 2 * rem:  # the odd member hands the even (idle) member its segment
        if i % 2:
            team.exchange([(_seg(buf, bounds[i - 1]), i - 1)], [])
        else:
            team.exchange([], [(_seg(buf, bounds[i]), i + 1)])


def doubling_all_gather(team: Team, buf: torch.Tensor, bounds: Bounds) -> None:
    """Recursive doubling all-gather for any p: member i contributes ``bounds[i]``."""
    p, i = team.size, team.index
    if p == 1:
        return
    rem, active = _fold_plan(p)
    if i < 2 * rem:  # idle even members hand their segment to their odd partner first
        if i % 2:
            team.exchange([], [(_seg(buf, bounds[i - 1]), i - 1)])
        else:
            team.exchange([(_seg(buf, bounds[i]), i + 1)], [])
    if i in active:
        sub = team.sub([team.members[a] for a in active])
        _doubling_gather(sub, buf, _active_blocks(bounds, rem, p))
    _fold_out(team, buf, rem)


# ------------------------------------------------------------------------------------------------
# Double binary tree (as in NCCL): two trees over the ranks, a leaf in one is interior in the
# other; each tree reduces then broadcasts one half of the buffer.
# ------------------------------------------------------------------------------------------------

def _btree_parent(r: int, p: int) -> int:
    if r == 0:
        return -1
    bit = r & -r
    up = (r ^ bit) | (bit << 1)
    return up if up < p else r ^ bit


def double_tree_parents(p: int) -> tuple[list[int], list[int]]:
    """Parent of every member in tree A and tree B (-1 at the root)."""
    a = [_btree_parent(r, p) for r in range(p)]
    if p % 2:  # odd: tree B is tree A shifted by one
        b = [-1 if (q := _btree_parent((r - 1) % p, p)) < 0 else (q + 1) % p for r in range(p)]
    else:  # even: tree B is tree A mirrored
        b = [-1 if (q := _btree_parent(p - 1 - r, p)) < 0 else p - 1 - q for r in range(p)]
    return a, b


def double_tree_all_reduce(team: Team, buf: torch.Tensor, op: str) -> None:
    p, i = team.size, team.index
    if p == 1:
        return
    trees = double_tree_parents(p)
    halves = chunk_bounds(buf.numel(), 2)
    kids = [[c for c in range(p) if parents[c] == i] for parents in trees]
    pending = []
    for t, parents in enumerate(trees):  # reduce: children first, then up (tree by tree, no cycles)
        seg = _seg(buf, halves[t])
        if not seg.numel():
            continue
        tmp = torch.empty_like(seg)
        for c in kids[t]:
            team.recv(tmp, c, tag=t)
            combine(seg, tmp, op)
        if parents[i] >= 0:
            pending.append(team.isend(seg, parents[i], tag=t))
    wait_all(pending)
    pending = []
    for t, parents in enumerate(trees):  # broadcast: from the parent, then down
        seg = _seg(buf, halves[t])
        if parents[i] >= 0:
            team.recv(seg, parents[i], tag=t)
        pending += [team.isend(seg, c, tag=t) for c in kids[t]]
    wait_all(pending)
