"""Every custom collective algorithm equals the built-in gloo collective, on real process groups.

One gloo job of 8 ranks runs the whole matrix (algorithm x size x dtype x op) on groups of 2, 3, 4, 5, 6
and 8 ranks, and on sub-groups that exclude rank 0 (so group ranks and global ranks differ).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stalwart.comm.algorithms import _fold_plan, double_tree_parents
from stalwart.comm.collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    all_gather,
    all_reduce,
    reduce_scatter,
)
from stalwart.comm.launch import run_workers
from stalwart.comm.team import chunk_bounds
from stalwart.comm.topology import Placement

F32, BF16 = torch.float32, torch.bfloat16


def _cases(p: int, full: bool) -> list[tuple[int, torch.dtype, str]]:
    """(numel, dtype, op): empty, fewer elements than ranks, not divisible by p, larger.

    Sums of small integers are exact in bf16 too, so only AVG needs a tolerance. The sub-group runs a
    shorter list (its job is the rank mapping, not the arithmetic).
    """
    if not full:
        return [(1, F32, "sum"), (p + 1, F32, "sum"), (1000, F32, "sum"), (p + 1, F32, "max")]
    return ([(n, F32, "sum") for n in (0, 1, p + 1, 1000)]
            + [(p + 1, F32, "avg"), (1, F32, "max"), (1000, F32, "max"),
               (p + 1, BF16, "sum"), (1000, BF16, "max"), (1000, BF16, "avg")])


def _close(a: torch.Tensor, b: torch.Tensor, op: str) -> bool:
    if op == "avg":
        tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-6
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
    return torch.equal(a, b)  # exact: integer-valued inputs make sums order-independent


def _run_matrix(group, me: int, p: int, placement: Placement, tag: str, full: bool) -> tuple[int, list[str]]:
    checked, bad = 0, []
    for n, dtype, op in _cases(p, full):
        g = torch.Generator().manual_seed(1000 * me + n)
        x = torch.randint(-4, 5, (n,), generator=g).to(dtype)
        ref = all_reduce(x.clone(), group, op, "builtin")
        for algo in ALL_REDUCE[:-1]:
            y = all_reduce(x.clone(), group, op, algo, placement)
            checked += 1
            if not _close(y, ref, op):
                bad.append(f"{tag} all_reduce {algo} n={n} {dtype} {op}")
        rs_ref = reduce_scatter(x, group, op, "builtin")
        for algo in REDUCE_SCATTER[:-1]:
            checked += 1
            if not _close(reduce_scatter(x, group, op, algo, placement), rs_ref, op):
                bad.append(f"{tag} reduce_scatter {algo} n={n} {dtype} {op}")
        if op != "sum":
            continue
        ag_ref = all_gather(rs_ref, n, group, "builtin")
        for algo in ALL_GATHER[:-1]:
            checked += 1
            if not torch.equal(all_gather(rs_ref, n, group, algo, placement), ag_ref):
                bad.append(f"{tag} all_gather {algo} n={n} {dtype}")
    # Real-valued data: sums agree within float tolerance (reduction orders differ).
    x = torch.randn(4099, generator=torch.Generator().manual_seed(me))
    ref = all_reduce(x.clone(), group, "sum", "builtin")
    for algo in ALL_REDUCE[:-1]:
        checked += 1
        if not torch.allclose(all_reduce(x.clone(), group, "sum", algo, placement), ref, rtol=1e-5, atol=1e-5):
            bad.append(f"{tag} all_reduce {algo} randn fp32")
    return checked, bad


SIZES = (2, 3, 4, 5, 6, 8)  # odd and even, one and several "hosts", up to a short last host


def check_sizes(rank: int, world: int) -> dict[int, tuple[int, list[str]]]:
    """The matrix on a group of each of ``SIZES`` ranks (0..p-1; the largest is the world group itself)
    inside one job, and on a sub-group excluding rank 0 from 5 ranks up: one job's start-up (about 2.5 s
    of CPU per spawned rank) instead of one per size. Every rank creates every group, in the same order
    (``new_group`` is collective over the world); ranks outside a group go on to the next one."""
    out = {}
    for p in SIZES:
        group = None if p == world else dist.new_group(list(range(p)))
        members = sorted(list(range(1, p, 2)) + [2]) if p >= 5 else []  # excludes rank 0: group rank != global
        sub = dist.new_group(members) if members else None
        if rank >= p:
            continue
        # Two ranks per host (the last host short when p is odd) so hierarchical has real structure.
        placement = Placement.from_hosts([r // 2 for r in range(p)])
        checked, bad = _run_matrix(group, rank, p, placement, f"size{p}", True)
        if rank in members:
            c, b = _run_matrix(sub, dist.get_rank(sub), len(members), placement, f"size{p} sub{members}", False)
            checked, bad = checked + c, bad + b
        out[p] = (checked, bad)
    # Multi-dimensional and non-contiguous tensors keep their shape and layout.
    t = torch.arange(12.0).reshape(3, 4).t() + rank
    ref = t.contiguous().clone()
    dist.all_reduce(ref)
    all_reduce(t, None, "sum", "rhd")
    if not torch.equal(t, ref):
        out[world][1].append("non-contiguous all_reduce")
    return out


@pytest.mark.multiproc
def test_algorithms_match_builtin() -> None:
    results = run_workers(check_sizes, max(SIZES), timeout_s=240)
    for rank, sizes in enumerate(results):
        assert sorted(sizes) == [p for p in SIZES if rank < p]
        for checked, bad in sizes.values():
            assert not bad, "\n".join(bad[:20])
    for p in SIZES:
        assert results[0][p][0] >= 120  # the matrix really ran at every size


# -------------------------------------------------------------------------------------------------
# Pure logic
# -------------------------------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("p", list(range(1, 70)))
def test_double_tree_is_two_trees_with_complementary_leaves(p: int) -> None:
    for parents in double_tree_parents(p):
        assert sum(1 for x in parents if x < 0) == 1
        for r in range(p):  # every rank reaches the root without a cycle
            seen, x = set(), r
            while parents[x] >= 0:
                assert x not in seen
                seen.add(x)
                x = parents[x]
            assert len([c for c in range(p) if parents[c] == r]) <= 2
    if p >= 4:
        a, b = double_tree_parents(p)
        interior_a = {x for x in a if x >= 0}
        interior_b = {x for x in b if x >= 0}
        # NCCL's property: (almost) no rank is interior in both trees, so load is spread.
        assert len(interior_a & interior_b) <= 1


@pytest.mark.unit
def test_chunk_bounds_and_fold_plan() -> None:
    assert chunk_bounds(7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert chunk_bounds(0, 4) == [(0, 0)] * 4
    assert chunk_bounds(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert _fold_plan(6) == (2, [1, 3, 4, 5])
    assert _fold_plan(8) == (0, list(range(8)))
