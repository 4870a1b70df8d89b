"""FSDP2 hooks that route its gradient reduce-scatter and parameter all-gather through the
topology-aware algorithms (`FSDPModule.set_custom_reduce_scatter` / `set_custom_all_gather`).

FSDP2 pads every flat buffer to a multiple of the group size, so the equal-chunk layout it expects is
exactly `chunk_bounds(n, p)` of our collectives. Reductions other than SUM/AVG/MAX (e.g. NCCL's
pre-multiplied sum) fall back to the process group's built-in collective.

The algorithms are point-to-point exchanges driven from Python, so they run on a :class:`CommThread`:
one thread per process that runs them one at a time in the order they were issued, on process groups
of its own (duplicates of FSDP's, so nothing the loop's thread sends on FSDP's groups can interleave
with them). An all-gather FSDP prefetches (``async_op=True``: the next block's parameters, issued
before the current block computes) returns at once with a ``dist.Work`` whose ``wait`` FSDP calls when
the block needs its parameters: the gather overlaps the current block's compute. FSDP2 consumes a
reduce-scatter's output as soon as the call returns, so that one is waited for (still on the thread,
so the order of collectives stays the same on every rank). ``CommThread.exposed_s`` counts the
seconds the loop spent waiting.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from stalwart.comm.selector import Selector
from stalwart.runtime.device import is_accelerator
from stalwart.runtime.group import cpu_group

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max"}


class CommThread:
    """Runs custom collectives in issue order on one thread and on duplicated process groups."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stalwart-comm")
        self._groups: dict[int, dist.ProcessGroup] = {}
        self._lock = threading.Lock()
        self.exposed_s = 0.0  # seconds the calling thread waited for a collective to finish
        self.busy_s = 0.0  # seconds the comm thread spent running collectives
        self.launched = 0  # collectives run on the thread
        self.overlapped = 0  # of which FSDP issued asynchronously (prefetched all-gathers)
        self.modules = 0  # FSDP modules whose hooks use this thread

    def own(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """This thread's duplicate of ``group`` (made once, by the group's members only, in the order
        FSDP first uses each group, which is the same on every member)."""
        key = id(group)
        if key not in self._groups:
            ranks = dist.get_process_group_ranks(group)
            self._groups[key] = cpu_group(ranks, use_local_synchronization=True)
        return self._groups[key]

    def submit(self, fn: Callable[[], None]) -> Future:
        def timed() -> None:
            t0 = time.perf_counter()
            try:
                fn()
            finally:
                with self._lock:
                    self.busy_s += time.perf_counter() - t0

        self.launched += 1
        return self._pool.submit(timed)

    def summary(self) -> dict:
        return {"launched": self.launched, "overlapped": self.overlapped, "exposed_s": round(self.exposed_s, 4),
                "thread_s": round(self.busy_s, 4)}

    def wait(self, fut: Future) -> None:
        t0 = time.perf_counter()
        try:
            fut.result()
        finally:
            self.exposed_s += time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _Pending(dist.Work):
    """A collective running on the comm thread, as FSDP waits for it."""

    def __init__(self, thread: CommThread, fut: Future) -> None:
        super().__init__()
        self._thread, self._fut = thread, fut

    def wait(self, timeout=None) -> bool:
        self._thread.wait(self._fut)
        return True

    def is_completed(self) -> bool:
        return self._fut.done()


class _Alloc:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class SelectorReduceScatter(_Alloc, ReduceScatter):
    def __init__(self, selector: Selector, thread: CommThread) -> None:
        self.selector, self.thread = selector, thread

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        name = _OPS.get(op) if isinstance(op, dist.ReduceOp.RedOpType) else None
        if name is None or is_accelerator(input_tensor.device):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        own = self.thread.own(group)

        def run() -> None:
            output_tensor.copy_(self.selector.reduce_scatter(input_tensor, own, name).view_as(output_tensor))

        fut = self.thread.submit(run)
        if async_op:
            self.thread.overlapped += 1
            return _Pending(self.thread, fut)
        self.thread.wait(fut)  # FSDP2 reads the output as soon as this returns
        return None


class SelectorAllGather(_Alloc, AllGather):
    def __init__(self, selector: Selector, thread: CommThread) -> None:
        self.selector, self.thread = selector, thread

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if is_accelerator(input_tensor.device):
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        own = self.thread.own(group)

        def run() -> None:
            out = self.selector.all_gather(input_tensor.reshape(-1), output_tensor.numel(), own)
            output_tensor.copy_(out.view_as(output_tensor))

        fut = self.thread.submit(run)
        if async_op:
            self.thread.overlapped += 1
            return _Pending(self.thread, fut)
        self.thread.wait(fut)
        return None


def install_on_fsdp(modules: list[torch.nn.Module], selector: Selector, overlap: bool = True) -> CommThread:
    """Install the hooks on every FSDP module in ``modules`` (and their submodules).

    ``overlap``: FSDP prefetches each block's all-gather asynchronously (``_set_unshard_async_op``, a
    private FSDP2 setter: the public prefetch setters keep a synchronous all-gather on CPU), so it runs
    on the comm thread while the previous block computes. Returns the comm thread; its ``modules`` is
    how many FSDP modules use it."""
    from torch.distributed.fsdp import FSDPModule

    thread = CommThread()
    rs, ag = SelectorReduceScatter(selector, thread), SelectorAllGather(selector, thread)
    count = 0
    for root in modules:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(rs)
                m.set_custom_all_gather(ag)
                count += 1
        if overlap and isinstance(root, FSDPModule):
            root._set_unshard_async_op(True)
            blocks = [b for b in getattr(root, "layers", {}).values() if isinstance(b, FSDPModule)]
            for i, block in enumerate(blocks):  # gather the next block while this one computes
                if i + 1 < len(blocks):
                    block.set_modules_to_forward_prefetch([blocks[i + 1]])
                if i > 0:
                    block.set_modules_to_backward_prefetch([blocks[i - 1]])
    thread.modules = count
    return thread
