"""Data parallel by replication: DDP's bucketed gradient all-reduce (``torch.distributed._composable.replicate``).

When every data-parallel rank holds the whole model (``dp_shard = 1``, nothing else split), there is
nothing for FSDP to gather or scatter: the step needs one gradient all-reduce, and DDP's reducer
starts it bucket by bucket while backward is still computing the earlier layers, so the transfer
hides behind compute (on CPU FSDP2's all-reduce blocks the backward pass until it ends). The
composable ``replicate`` is DDP's reducer applied in place: the module keeps its class behaviour and
its parameter names, so the optimizer, the checkpoint and the state-dict helpers see the same model
as without it (torchtitan applies DDP the same way).

Two settings keep the results what the rest of Stalwart promises:

- ``find_unused_parameters``: with it, DDP keeps the bucket layout it starts with instead of
  rebuilding it from the first step's gradient order (measured on the reference model: the rebuilt
  order is not the reverse parameter order it starts from). A rebuilt layout moves where each
  gradient sits inside the all-reduced buffers, and with three or more ranks gloo's ring all-reduce
  adds a value's contributions in an order that depends on that position, so a resumed run (whose
  DDP has not rebuilt yet) would differ in the last bits from the run it continues. With two ranks
  the sum is one addition, the same whichever way round, so the layout cannot change a bit and the
  flag (an extra walk of the autograd graph every step, and a warning from DDP) is left off. A
  mixture-of-experts model always sets it: a routed expert no token chose gets no gradient.
- Mixed precision is the per-block cast of ``parallel/precision.py``: DDP has no public casting
  policy, and the cast gives the policy FSDP applies elsewhere (bf16 compute, fp32 gradients
  reduced, fp32 master weights).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn


def keeps_bucket_layout(world: int) -> bool:
    """Whether DDP must keep its first bucket layout (by looking for unused parameters): with more than
    two replicas the summation order follows the layout."""
    return world > 2


def apply_replicate(model: nn.Module, group: dist.ProcessGroup, bucket_cap_mb: float) -> None:
    """Replicate ``model`` over ``group`` (it may still be on the meta device: :func:`start_replicas`
    builds DDP's reducer once the parameters are real); gradients are averaged over its ranks in buckets
    of ``bucket_cap_mb`` (``comm.bucket_mb``; the first closes at 1 MiB, DDP's own rule)."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, process_group=group, bucket_cap_mb=bucket_cap_mb,
              find_unused_parameters=keeps_bucket_layout(group.size()), gradient_as_bucket_view=True)


def start_replicas(stages: list[nn.Module]) -> None:
    """Build DDP's reducer over the materialized parameters now, before any forward. Left to itself it
    would build at the first forward, and under the mixed-precision cast that forward sees the bf16
    copies in place of the parameters: the reducer would hook the copies and never average a
    gradient."""
    from torch.distributed._composable.replicate import replicate

    for stage in stages:
        replicate.state(stage).lazy_init()


def time_all_reduce(stage: nn.Module) -> None:
    """Have DDP time every step's backward and all-reduce (by default it samples one step in 100)."""
    from torch.distributed._composable.replicate import replicate

    replicate.state(stage)._ddp._set_ddp_runtime_logging_sample_rate(1)


def exposed_all_reduce_ms(stage: nn.Module) -> dict[str, float]:
    """DDP's own averages over the timed steps, in ms: the all-reduce's span from the first bucket's start
    to the last one's end, the part of it that ran beside backward's compute, and the rest (exposed: the
    time backward waited for communication after its compute had ended)."""
    from torch.distributed._composable.replicate import replicate

    data = replicate.state(stage)._ddp._get_ddp_logging_data()
    span = data.get("avg_backward_comm_time", 0) / 1e6
    # DDP's "overlap" runs from the first bucket's start to the end of backward's compute, which can be
    # later than the last bucket's end: then all of the span was hidden.
    beside = min(span, data.get("avg_backward_compute_comm_overlap_time", 0) / 1e6)
    return {"all_reduce_ms": span, "overlapped_ms": beside, "exposed_ms": span - beside}
