"""Gradients whose sum does not depend on the number of processes (``training.elastic_exact``).

A data-parallel step sums one gradient per micro-batch. Floating-point addition is not associative, so
the sum's last bits depend on the order of the additions, and the usual order depends on the number of
processes: each rank accumulates its own micro-batches one after another, then the all-reduce adds the
ranks' partial sums in whatever order its algorithm (ring, tree, the backend's) chooses. A run stopped
at 4 processes and resumed at 2 therefore drifts from the run that kept 4, by a few ulps at first.

Here the order is fixed by the global batch instead. The ``L = global_batch / micro_batch`` micro-batches
of a step are the leaves of one canonical binary tree: node ``(lo, size)`` (``size`` a power of two,
``lo`` a multiple of it) covers leaves ``[lo, lo + size)``, and its value is the sum of its two halves,
left + right, or the left half alone when the right one starts at or past ``L``. Data-parallel rank
``r`` of ``W`` holds the contiguous leaves ``[r L / W, (r + 1) L / W)`` (the data loader already gives
every rank its contiguous slots of the global batch); it cuts them into maximal aligned blocks, sums
each block with the same recursion as the micro-batches arrive (keeping at most one partial sum per
tree level), and the ranks exchange their blocks (one all-gather) and finish the tree on every rank.
Every addition is therefore the same whichever ranks hold the leaves: 1, 2, 4 processes (any ``W``
that divides ``L``) give the same bits. The loss of each micro-batch rides along as one more element,
so the reported loss is world-size independent too.

What it costs: one flat copy of the gradients per micro-batch (plus one per tree level held), an
all-gather of ``W x`` the gradient size in place of an all-reduce, and no overlap of communication
with backward (DDP's bucketed all-reduce is not used). ``stalwart bench throughput --elastic-exact``
measures it against the default.
"""

from __future__ import annotations

import torch

from stalwart.errors import UserError


def blocks(lo: int, hi: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into maximal aligned power-of-two blocks, as ``(start, size)``, in order."""
    out = []
    while lo < hi:
        size = lo & -lo if lo else 1 << (hi - 1).bit_length()
        while lo + size > hi:
            size //= 2
        out.append((lo, size))
        lo += size
    return out


def tree_sum(leaves: int, nodes: dict[tuple[int, int], torch.Tensor], lo: int = 0,
             size: int | None = None) -> torch.Tensor | None:
    """The canonical tree's value at ``(lo, size)`` (the root by default) from the known ``nodes``."""
    if size is None:
        size = 1 << max(0, (leaves - 1).bit_length())
    if lo >= leaves:
        return None
    if (lo, size) in nodes:
        return nodes[(lo, size)]
    if size == 1:
        raise KeyError(f"leaf {lo} of the gradient tree is missing")
    half = size // 2
    left = tree_sum(leaves, nodes, lo, half)
    right = tree_sum(leaves, nodes, lo + half, half)
    return left if right is None else left + right


class TreeAccumulator:
    """This rank's micro-batch values summed into its blocks of the canonical tree, streaming."""

    def __init__(self, leaves: int, rank: int, world: int) -> None:
        if leaves % world:
            raise UserError(f"training.elastic_exact needs the {leaves} micro-batches of a step "
                            f"(training.global_batch / training.micro_batch) to divide evenly over the "
                            f"{world} data-parallel ranks")
        self.leaves, self.rank, self.world = leaves, rank, world
        per = leaves // world
        self.lo, self.hi = rank * per, (rank + 1) * per
        self.mine = blocks(self.lo, self.hi)
        self._stack: list[tuple[int, int, torch.Tensor]] = []
        self._next = self.lo

    def _merges(self, lo: int, size: int) -> bool:
        """Whether the aligned block (lo, 2 * size) lies inside one of this rank's blocks."""
        if lo % (2 * size):
            return False
        return any(b_lo <= lo and lo + 2 * size <= b_lo + b_size for b_lo, b_size in self.mine)

    def push(self, value: torch.Tensor) -> None:
        """Add the next micro-batch's value (leaves arrive in order)."""
        self._stack.append((self._next, 1, value))
        self._next += 1
        while len(self._stack) >= 2:
            (lo1, s1, a), (lo2, s2, b) = self._stack[-2], self._stack[-1]
            if s1 != s2 or lo2 != lo1 + s1 or not self._merges(lo1, s1):
                break
            self._stack[-2:] = [(lo1, 2 * s1, a + b)]

    def total(self, group=None, shards: int = 1) -> torch.Tensor:
        """The root of the tree on every rank: this rank's blocks exchanged with the others' (``group``:
        the data-parallel group; None on one process). With ``shards > 1`` every value is a
        ``(shards, n)`` stack of slices (FSDP's reduce-scatter layout) and a rank receives and sums only
        slice ``rank % shards`` of every block (one all-to-all): the root of its own slice."""
        if self._next != self.hi:
            raise RuntimeError(f"rank {self.rank} summed {self._next - self.lo} of its {self.hi - self.lo} "
                               "micro-batches")
        nodes = {(lo, size): v for lo, size, v in self._stack}
        if shards > 1:
            nodes = self._exchange_slices(group, shards)
        elif self.world > 1:
            import torch.distributed as dist

            layout, width = self._layout()
            first = self._stack[0][2]
            if width == 1:  # one block (every rank's share a power of two): sent as it is, not copied
                mine = first.reshape(1, -1)
            else:
                mine = torch.zeros(width, first.numel(), dtype=first.dtype, device=first.device)
                for i, (_, _, v) in enumerate(self._stack):
                    mine[i] = v
            gathered = torch.empty(self.world * width, first.numel(), dtype=first.dtype, device=first.device)
            dist.all_gather_single(gathered, mine, group=group)
            nodes = {blk: gathered[r * width + i] for r, rank_blocks in enumerate(layout)
                     for i, blk in enumerate(rank_blocks)}
        self._stack, self._next = [], self.lo
        return tree_sum(self.leaves, nodes)

    def _layout(self) -> tuple[list[list[tuple[int, int]]], int]:
        """Every rank's blocks, and the most any rank has (the exchange's width)."""
        per = self.leaves // self.world
        layout = [blocks(r * per, (r + 1) * per) for r in range(self.world)]
        return layout, max(len(b) for b in layout)

    def _exchange_slices(self, group, shards: int) -> dict[tuple[int, int], torch.Tensor]:
        """Every rank's blocks, slice ``rank % shards`` of each, by one all-to-all over ``group``."""
        import torch.distributed as dist

        layout, width = self._layout()
        first = self._stack[0][2].reshape(shards, -1)
        # (to rank, block, slice): rank q gets slice q % shards of each of this rank's blocks
        send = torch.zeros(self.world, width, first.shape[1], dtype=first.dtype, device=first.device)
        for i, (_, _, v) in enumerate(self._stack):
            send[:, i] = v.reshape(shards, -1).repeat(self.world // shards, 1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return {blk: recv[r, i] for r, rank_blocks in enumerate(layout) for i, blk in enumerate(rank_blocks)}


def flat_grads(params: list[torch.nn.Parameter], extra: torch.Tensor) -> torch.Tensor:
    """Every parameter's gradient (zeros for one that got none) and ``extra`` in one fp32 vector; the
    gradients are released."""
    parts = []
    for p in params:
        parts.append(p.grad.reshape(-1).float() if p.grad is not None
                     else torch.zeros(p.numel(), dtype=torch.float32, device=p.device))
        p.grad = None
    parts.append(extra.reshape(-1).float())
    return torch.cat(parts)


def assign_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> torch.Tensor:
    """The gradients become views of ``flat`` (no copy; ``flat`` must be the caller's own); returns what
    follows them (the extra values)."""
    off = 0
    for p in params:
        p.grad = flat[off:off + p.numel()].view_as(p).to(p.dtype)
        off += p.numel()
    return flat[off:]


class TreeReduceScatter:
    """FSDP2's gradient reduce-scatter of one module, replaced by the canonical tree (``dp_shard`` under
    ``training.elastic_exact``; installed by :func:`apply_tree_reduce_scatter`).

    FSDP calls it once per micro-batch with the module's unsharded gradients laid out as one
    ``(dp_shard, n)`` stack of padded shards. Each call's input joins this rank's blocks of the tree;
    the output of every micro-batch but the step's last is ``-0.0``, the one value whose addition changes
    no bit (``x + -0.0 == x`` for every ``x``, signed zeros included), so FSDP's accumulation of the
    outputs into the sharded gradients is exact. At the last micro-batch the ranks exchange their
    blocks' slices (one all-to-all over the data-parallel group) and each writes the root of its own
    slice, divided by the number of micro-batches: element for element the replicated path's value.
    Under HSDP the replicas of a shard all hold that root, and only the first writes it (the others
    write ``-0.0``), so FSDP's all-reduce over the replicas changes no bit either."""

    def __init__(self, leaves: int, dp_rank: int, dp: int, dp_shard: int, group, last: list[bool]) -> None:
        self.acc = TreeAccumulator(leaves, dp_rank, dp)
        self.shards, self.group, self.last = dp_shard, group, last
        self.writes = dp_rank < dp_shard  # the first replica of its shard

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.acc.push(input_tensor)
        if not self.last[0]:
            output_tensor.fill_(-0.0)
            return None
        root = self.acc.total(self.group, self.shards)
        if self.writes:
            output_tensor.copy_(root.div_(self.acc.leaves).view_as(output_tensor))
        else:
            output_tensor.fill_(-0.0)
        return None


def apply_tree_reduce_scatter(stages: list[torch.nn.Module], leaves: int, dp_rank: int, dp: int, dp_shard: int,
                              group) -> list[bool]:
    """Give every FSDP module in ``stages`` its :class:`TreeReduceScatter` (exchanging over ``group``, the
    data-parallel group), reducing by plain sums. Returns the flag the step sets to True before its
    last micro-batch's backward."""
    from torch.distributed.fsdp import FSDPModule

    last = [False]
    for stage in stages:
        for m in stage.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(TreeReduceScatter(leaves, dp_rank, dp, dp_shard, group, last))
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
    return last


def tree_grad_norm(params: list[torch.nn.Parameter], shard_group=None, shards: int = 1) -> torch.Tensor:
    """The 2-norm of all gradients with additions that do not depend on the layout: each row's sum of
    squares (a row along dim 0 is never split by FSDP), the rows of each parameter gathered whole
    (``shard_group``: the FSDP shard group of ``shards`` ranks; None when nothing is sharded) and summed,
    then the parameters' sums in parameter order."""
    rows = []
    for p in params:
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        sq = g.float().square()
        rows.append(sq.sum(dim=tuple(range(1, sq.ndim))) if sq.ndim > 1 else sq.reshape(-1))
    if shards > 1:
        import torch.distributed as dist

        sizes = [p.shape[0] if p.ndim else 1 for p in params]
        chunk = [-(-n // shards) for n in sizes]
        mine = torch.cat([torch.nn.functional.pad(r, (0, c - r.numel())) for r, c in zip(rows, chunk)])
        gathered = torch.empty(shards * mine.numel(), dtype=mine.dtype, device=mine.device)
        dist.all_gather_single(gathered, mine, group=shard_group)
        gathered = gathered.view(shards, -1)
        rows, off = [], 0
        for n, c in zip(sizes, chunk):
            rows.append(gathered[:, off:off + c].reshape(-1)[:n])  # FSDP's chunks: c rows each, the last short
            off += c
    return torch.stack([r.sum() for r in rows]).sum().sqrt()


class GroupTree:
    """One rank's leaves of one step summed into blocks of the canonical tree, for any set of intervals.

    ``push(interval, leaf, value)`` adds the value of one leaf of ``interval`` (used by a replica group,
    ``train/replicas.py``); the leaves of each interval arrive in order.
    ``layout(assign)`` lists every present rank's blocks; ``root(gathered, assign)`` finishes the tree
    from the all-gathered blocks."""

    def __init__(self, leaves: int) -> None:
        self.leaves = leaves
        self.nodes: dict[tuple[int, int], torch.Tensor] = {}  # finished blocks
        self._open: dict[tuple[int, int], list[tuple[int, int, torch.Tensor]]] = {}  # interval -> stack

    def push(self, interval: tuple[int, int], leaf: int, value: torch.Tensor) -> None:
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

    def have(self, interval: tuple[int, int]) -> bool:
        """Whether every block of ``interval`` is summed here."""
        return all(b in self.nodes for b in blocks(*interval))

    def drop(self, interval: tuple[int, int]) -> None:
        """Forget what was summed of ``interval`` (its leaves are computed again)."""
        self._open.pop(interval, None)
        for b in blocks(*interval):
            self.nodes.pop(b, None)

    @staticmethod
    def layout(assign: dict[tuple[int, int], list[tuple[int, int]]]) -> tuple[list[list[tuple[int, int]]], int]:
        """Every present rank's blocks in the cross group's rank order, and the most any rank has."""
        per_rank = [[b for iv in assign[r] for b in blocks(*iv)] for r in sorted(assign)]
        return per_rank, max(len(b) for b in per_rank)

    def mine(self, intervals: list[tuple[int, int]], width: int) -> torch.Tensor:
        """This rank's blocks of ``intervals`` stacked ``(width, n)``, zero rows after them."""
        own = [self.nodes[b] for iv in intervals for b in blocks(*iv)]
        if width == 1:  # one block: sent as it is, not copied
            return own[0].reshape(1, -1)
        out = torch.zeros(width, own[0].numel(), dtype=own[0].dtype, device=own[0].device)
        for i, v in enumerate(own):
            out[i] = v
        return out

    def root(self, gathered: torch.Tensor, assign: dict[tuple[int, int], list[tuple[int, int]]]) -> torch.Tensor:
        """The tree's root from ``gathered`` (``(ranks * width, n)``, the all-gather of every rank's
        :meth:`mine`)."""
        layout, width = self.layout(assign)
        nodes = {blk: gathered[r * width + i] for r, rank_blocks in enumerate(layout) for i, blk in enumerate(rank_blocks)}
        return tree_sum(self.leaves, nodes)


def check_elastic_layout(dims, optimizer: str = "adamw") -> None:
    """``training.elastic_exact`` sums whole micro-batch gradients: every data-parallel rank computes with
    the whole model (replicated, or FSDP-sharded and gathered), and the update must not depend on how
    the parameters are split."""
    split = {k: getattr(dims, k) for k in ("tp", "pp", "cp", "ep") if getattr(dims, k) > 1}
    if split:
        what = ", ".join(f"{k}={v}" for k, v in split.items())
        raise UserError(f"training.elastic_exact needs every data-parallel rank to compute with the whole model "
                        f"(replicated or FSDP data parallel); this layout splits it ({what}): use only "
                        "dp_replicate/dp_shard, or turn elastic_exact off")
    if dims.dp_shard > 1 and optimizer != "adamw":
        raise UserError(f"training.elastic_exact with dp_shard > 1 needs --optimizer.name adamw ({optimizer} takes "
                        "norms over whole sharded tensors, whose sums depend on the number of shards)")
