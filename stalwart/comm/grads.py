"""Data-parallel gradient reduction with the selected algorithms: a function and a DDP comm hook.

``reduce_gradients(params, group, selector)`` is what a trainer calls after ``backward()`` instead of
letting DDP/FSDP reduce; ``register_selector_hook(ddp_model, selector)`` plugs the same algorithms into
``torch.nn.parallel.DistributedDataParallel`` through its ``register_comm_hook`` interface, and
``install_on_replicate`` into the replicated layout's DDP (``parallel/replicate.py``).

With a :class:`~stalwart.comm.fsdp_comm.CommThread` the hook runs each bucket's all-reduce on that
thread (in issue order, which DDP keeps the same on every rank, on the thread's duplicated group) and
returns at once: DDP waits for the future only at the end of backward, so the bucket travels while
backward computes the earlier layers. Without one it reduces in place before returning.
"""

# NOTE: no `from __future__ import annotations` here: DDP inspects the hook's annotations at runtime.
import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist

from stalwart.comm import collectives as coll
from stalwart.comm.fsdp_comm import CommThread
from stalwart.comm.selector import Selector


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive same-dtype gradients, at most ``bucket_bytes`` each (a bigger tensor is alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nb = g.numel() * g.element_size()
        if out and out[-1][0].dtype == g.dtype and size + nb <= bucket_bytes:
            out[-1].append(g)
            size += nb
        else:
            out.append([g])
            size = nb
    return out


@torch.no_grad()
def reduce_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None,
                     selector: Selector | None = None, op: object = "avg", bucket_mb: float = 25.0) -> None:
    """All-reduce every ``.grad`` of ``params`` over ``group`` (in place), bucketed and flattened.

    Every rank must pass the same parameters in the same order with the same grads present (as DDP
    requires). ``selector=None`` uses the built-in all-reduce.
    """
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads, int(bucket_mb * 2**20)):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        if selector is None:
            coll.all_reduce(flat, group, op, "builtin")
        else:
            selector.all_reduce(flat, group, op)
        off = 0
        for g in bucket:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()


@dataclasses.dataclass
class HookState:
    selector: Selector
    group: dist.ProcessGroup | None = None
    thread: CommThread | None = None  # run on it, asynchronously (``group`` is then the thread's own)


def selector_comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook averaging each gradient bucket with the selected algorithm (divided
    by the group's size first, then summed, as DDP's own all-reduce hook does)."""
    buf = bucket.buffer()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def run() -> None:
        try:
            buf.div_(state.group.size() if state.group is not None else dist.get_world_size())
            state.selector.all_reduce(buf, state.group, "sum")
        except BaseException as exc:  # raised again where DDP waits, at the end of backward
            fut.set_exception(exc)
            raise
        fut.set_result(buf)

    if state.thread is None:
        run()
    else:
        state.thread.submit(run)
        state.thread.overlapped += 1
    return fut


def register_selector_hook(model: torch.nn.parallel.DistributedDataParallel, selector: Selector,
                           group: dist.ProcessGroup | None = None) -> None:
    model.register_comm_hook(HookState(selector, group), selector_comm_hook)


def install_on_replicate(stages: list[torch.nn.Module], selector: Selector, group: dist.ProcessGroup,
                         overlap: bool = True) -> CommThread:
    """Register the hook on every stage replicated by ``parallel/replicate.py`` (before its reducer is
    built). ``overlap``: on the comm thread (False: in place, backward waits for each bucket). Returns the
    comm thread; its ``modules`` is how many stages use it."""
    thread = CommThread()
    state = HookState(selector, thread.own(group), thread if overlap else None)
    for stage in stages:
        stage.register_comm_hook(state, selector_comm_hook)
    thread.modules = len(stages)
    return thread
