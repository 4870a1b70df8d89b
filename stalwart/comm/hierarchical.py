"""Two-level (topology-aware) collectives: within a host, then across hosts among one leader each.

All-reduce, leader-based (``hier_*``): reduce to the host leader -> all-reduce among leaders (a flat
algorithm) -> broadcast within the host. Only one rank per host sends across the slow tier, once, so
the slow tier sees H ranks instead of p: fewer slow steps, less traffic than a flat ring.
All-reduce, two-dimensional (``hier2d_*``): the same with reduce-scatter/all-gather inside the host,
so every local rank carries 1/k of the data across hosts (no leader bottleneck for large buffers).

Reduce-scatter / all-gather use the same shape with host blocks: the segments of a host's members,
made contiguous by permuting the buffer into host order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stalwart.comm import algorithms as flat
from stalwart.comm.team import Bounds, Team, chunk_bounds, combine, wait_all
from stalwart.comm.topology import Placement


def _host_teams(team: Team, placement: Placement) -> tuple[Team, Team | None, list[list[int]]]:
    """(my host's team, the leaders' team or None if I am not a leader, member indices per host)."""
    by_host: dict[int, list[int]] = {}
    for idx, g in enumerate(team.members):
        by_host.setdefault(placement.host(g), []).append(idx)
    hosts = list(by_host.values())
    mine = next(h for h in hosts if team.index in h)
    local = team.sub([team.members[k] for k in mine])
    leaders = [team.members[h[0]] for h in hosts]
    return local, (team.sub(leaders) if team.index == mine[0] else None), hosts


def _reduce_to_leader(local: Team, buf: torch.Tensor, op: str) -> None:
    if local.index == 0:
        tmp = torch.empty_like(buf)
        for k in range(1, local.size):
            local.recv(tmp, k)
            combine(buf, tmp, op)
    else:
        local.exchange([(buf, 0)], [])


def _broadcast_from_leader(local: Team, buf: torch.Tensor) -> None:
    if local.index == 0:
        wait_all([local.isend(buf, k) for k in range(1, local.size)])
    else:
        local.recv(buf, 0)


INTER: dict[str, Callable[[Team, torch.Tensor, str], None]] = {
    "ring": flat.ring_all_reduce,
    "rd": flat.recursive_doubling_all_reduce,
    "rhd": flat.rabenseifner_all_reduce,
}


def hierarchical_all_reduce(team: Team, buf: torch.Tensor, op: str, placement: Placement,
                            inter: str = "ring") -> None:
    local, leaders, _ = _host_teams(team, placement)
    _reduce_to_leader(local, buf, op)
    if leaders is not None:
        INTER[inter](leaders, buf, op)
    _broadcast_from_leader(local, buf)


def hierarchical_2d_all_reduce(team: Team, buf: torch.Tensor, op: str, placement: Placement,
                               inter: str = "ring") -> None:
    """Reduce-scatter within the host -> all-reduce each shard across hosts -> all-gather within the host.

    Every local rank works on 1/k of the buffer, so the k ranks of a host use the uplink together on
    disjoint data: the slow tier carries the buffer once per host, and no leader is a bottleneck.
    Needs the same number of ranks on every host; otherwise it is the leader-based algorithm.
    """
    local, _, hosts = _host_teams(team, placement)
    if len({len(h) for h in hosts}) > 1:
        hierarchical_all_reduce(team, buf, op, placement, inter)
        return
    bounds = chunk_bounds(buf.numel(), local.size)
    flat.ring_reduce_scatter(local, buf, bounds, op)
    j = local.index
    cross = team.sub([team.members[h[j]] for h in hosts])
    off, n = bounds[j]
    INTER[inter](cross, buf[off:off + n], op)
    flat.ring_all_gather(local, buf, bounds)


def _host_order(bounds: Bounds, hosts: list[list[int]]) -> tuple[list[int], Bounds, Bounds]:
    """(member order grouped by host, segment bounds in the permuted buffer, host-block bounds)."""
    order = [k for h in hosts for k in h]
    perm_bounds: Bounds = [(0, 0)] * len(bounds)
    off = 0
    for k in order:
        perm_bounds[k] = (off, bounds[k][1])
        off += bounds[k][1]
    blocks = []
    for h in hosts:
        start = perm_bounds[h[0]][0]
        blocks.append((start, sum(bounds[k][1] for k in h)))
    return order, perm_bounds, blocks


def _permute(buf: torch.Tensor, src: Bounds, dst: Bounds, order: list[int]) -> torch.Tensor:
    out = torch.empty_like(buf)
    for k in order:
        (so, n), (do, _) = src[k], dst[k]
        out[do:do + n] = buf[so:so + n]
    return out


def hierarchical_reduce_scatter(team: Team, buf: torch.Tensor, bounds: Bounds, op: str,
                                placement: Placement) -> None:
    """Member i ends with ``bounds[i]`` of ``buf`` reduced (other parts of ``buf`` are scratch)."""
    local, leaders, hosts = _host_teams(team, placement)
    _reduce_to_leader(local, buf, op)
    mine = next(h for h in hosts if team.index in h)
    if leaders is not None:
        order, pb, blocks = _host_order(bounds, hosts)
        perm = _permute(buf, bounds, pb, order)
        flat.ring_reduce_scatter(leaders, perm, blocks, op)
        pending = []
        for pos, k in enumerate(mine):
            o, n = pb[k]
            if pos == 0:
                buf[bounds[k][0]:bounds[k][0] + n] = perm[o:o + n]
            else:
                pending.append(local.isend(perm[o:o + n], pos))
        wait_all(pending)
    else:
        o, n = bounds[team.index]
        local.recv(buf[o:o + n], 0)


def hierarchical_all_gather(team: Team, buf: torch.Tensor, bounds: Bounds, placement: Placement) -> None:
    """Member i contributes ``bounds[i]`` of ``buf``; afterwards every member holds all of it."""
    local, leaders, hosts = _host_teams(team, placement)
    mine = next(h for h in hosts if team.index in h)
    if leaders is not None:
        for pos, k in enumerate(mine[1:], start=1):
            o, n = bounds[k]
            local.recv(buf[o:o + n], pos)
        order, pb, blocks = _host_order(bounds, hosts)
        perm = _permute(buf, bounds, pb, order)
        flat.ring_all_gather(leaders, perm, blocks)
        buf.copy_(_permute(perm, pb, bounds, order))
    else:
        o, n = bounds[team.index]
        local.exchange([(buf[o:o + n], 0)], [])
    _broadcast_from_leader(local, buf)
