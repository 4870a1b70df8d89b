"""Data-parallel gradient reduction with the selected algorithms: a function and a DDP comm hook.

``reduce_gradients(params, group, selector)`` is what a trainer calls after ``backward()`` instead of
letting DDP/FSDP reduce; ``register_selector_hook(ddp_model, selector)`` plugs the same algorithms into
``torch.nn.parallel.DistributedDataParallel`` through its ``register_comm_hook`` interface.
"""

# NOTE: no `from __future__ import annotations` here: DDP inspects the hook's annotations at runtime.
import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist

from stalwart.comm import collectives as coll
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


def selector_comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook averaging each gradient bucket with the selected algorithm.

    NOTE: the reduction runs synchronously inside the hook (the p2p algorithms are driven from Python),
    so it does not overlap with the rest of backward the way DDP's built-in async all-reduce does.
    """
    buf = bucket.buffer()
    state.selector.all_reduce(buf, state.group, "avg")
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def register_selector_hook(model: torch.nn.parallel.DistributedDataParallel, selector: Selector,
                           group: dist.ProcessGroup | None = None) -> None:
    model.register_comm_hook(HookState(selector, group), selector_comm_hook)
