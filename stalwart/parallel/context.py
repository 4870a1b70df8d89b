"""Context parallelism: ring attention over point-to-point communication.

Each context-parallel rank holds two of the 2*cp equal chunks of every sequence (chunks i and
2cp-1-i, which balances causal work) and its queries attend to every rank's keys/values as they pass
around the ring. Partial results are merged with the log-sum-exp trick (as in FlashAttention), and
the backward pass sends key/value gradients around the ring back to their owners. Masks are built
from absolute positions, so causal and sliding-window attention both work. Pure torch + isend/irecv:
runs on gloo (CPU) and NCCL alike. (PyTorch's own context-parallel API only shards the CUDA
attention kernels.)
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

NEG = -1e30  # finite "minus infinity": fully masked blocks then merge with weight exp(NEG) == 0


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    return cp_rank, 2 * cp - 1 - cp_rank


def cp_positions(seq_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Absolute positions of the tokens this rank holds, in its local order."""
    chunk = seq_len // (2 * cp)
    a, b = chunk_ids(cp_rank, cp)
    return torch.cat([torch.arange(a * chunk, (a + 1) * chunk, device=device),
                      torch.arange(b * chunk, (b + 1) * chunk, device=device)])


def shard_sequence(t: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    chunks = t.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(cp_rank, cp)
    return torch.cat([chunks[a], chunks[b]], dim=dim).contiguous()


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    diff = q_pos.unsqueeze(-1) - k_pos.unsqueeze(0)
    ok = diff >= 0
    if window > 0:
        ok &= diff < window
    return ok  # (s_q, s_k)


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(dim=2)


class _Ring:
    """Send to the next rank / receive from the previous one within the context-parallel group."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.exposed_s = 0.0  # seconds blocked waiting for shifts (see _Shift)

    def start(self, tensor: torch.Tensor, tag: int = 0) -> _Shift:
        """Send ``tensor`` to the next rank and receive the previous rank's in the background; the
        caller computes meanwhile (without writing ``tensor``) and calls ``wait`` for the result."""
        out = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), self.next, self.group, tag),
               dist.P2POp(dist.irecv, out, self.prev, self.group, tag)]
        return _Shift(self, dist.batch_isend_irecv(ops), out)

    def shift(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.start(tensor).wait()


class _Shift:
    """A ring shift in flight; the time spent blocked in ``wait`` (communication not hidden behind
    compute) adds up in the ring's ``exposed_s``."""

    def __init__(self, ring: _Ring, reqs, out: torch.Tensor) -> None:
        self.ring, self.reqs, self.out = ring, reqs, out

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        for req in self.reqs:
            req.wait()
        self.ring.exposed_s += time.perf_counter() - t0
        return self.out


_KV, _DKV = 1, 2  # message tags: key/value blocks and their gradients travel separately


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, ring: _Ring, seq_len: int, window: int):
        # q: (b, h, s, d); k, v: (b, hk, s, d); all local. Compute in fp32.
        scale = 1.0 / math.sqrt(q.shape[-1])
        groups = q.shape[1] // k.shape[1]
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:3], NEG, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).float()
        for t in range(ring.size):
            # The next block is on its way while this one is computed (kv is only read below).
            nxt = ring.start(kv, _KV) if t < ring.size - 1 else None
            src = (ring.rank - t) % ring.size
            k_pos = cp_positions(seq_len, src, ring.size, q.device)
            kk, vv = _expand_kv(kv[0], groups), _expand_kv(kv[1], groups)
            s = torch.matmul(qf, kk.transpose(-1, -2)) * scale
            s = s.masked_fill(~_allowed(q_pos, k_pos, window), NEG)
            blk_lse = torch.logsumexp(s, dim=-1)
            blk_out = torch.matmul(torch.exp(s - blk_lse.unsqueeze(-1)), vv)
            new_lse = torch.logaddexp(lse, blk_lse)
            out = out * torch.exp(lse - new_lse).unsqueeze(-1) + blk_out * torch.exp(blk_lse - new_lse).unsqueeze(-1)
            lse = new_lse
            if nxt is not None:
                kv = nxt.wait()
        ctx.save_for_backward(q, k, v, q_pos, out, lse)
        ctx.ring, ctx.seq_len, ctx.window = ring, seq_len, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, q_pos, out, lse = ctx.saved_tensors
        ring, seq_len, window = ctx.ring, ctx.seq_len, ctx.window
        scale = 1.0 / math.sqrt(q.shape[-1])
        groups = q.shape[1] // k.shape[1]
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(-1, keepdim=True)  # (b, h, s, 1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).float()
        # The key/value block travels ahead (sent before its compute); the gradient accumulated for
        # it by the previous ranks follows separately and is needed only after the compute, so both
        # transfers overlap this rank's work. After ``size`` hops the gradient is back home.
        dkv_in: _Shift | None = None
        for t in range(ring.size):
            nxt = ring.start(kv, _KV) if t < ring.size - 1 else None
            src = (ring.rank - t) % ring.size
            k_pos = cp_positions(seq_len, src, ring.size, q.device)
            kk, vv = _expand_kv(kv[0], groups), _expand_kv(kv[1], groups)
            s = torch.matmul(qf, kk.transpose(-1, -2)) * scale
            allowed = _allowed(q_pos, k_pos, window)
            p = torch.exp(s - lse.unsqueeze(-1)).masked_fill(~allowed, 0.0)
            dv = torch.matmul(p.transpose(-1, -2), do)
            dp = torch.matmul(do, vv.transpose(-1, -2))
            ds = p * (dp - delta)
            dq += torch.matmul(ds, kk) * scale
            dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
            dkv = torch.zeros_like(kv) if dkv_in is None else dkv_in.wait()
            dkv[0] += _fold_kv(dk, groups)
            dkv[1] += _fold_kv(dv, groups)
            dkv_in = ring.start(dkv, _DKV)  # on to the next rank; the previous rank's arrives
            if nxt is not None:
                kv = nxt.wait()
        dkv = dkv_in.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


class RingAttention(nn.Module):
    """Drop-in replacement for ``CoreAttention`` on a context-parallel rank."""

    def __init__(self, sliding_window: int, cp_group) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.ring = _Ring(cp_group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        seq_len = q.shape[2] * self.ring.size
        return _RingAttention.apply(q, k, v, positions, self.ring, seq_len, self.sliding_window)


def apply_context_parallel(model: nn.Module, cp_group) -> None:
    """Swap every block's attention kernel for ring attention over ``cp_group``."""
    for block in model.layers.values():
        block.attention.core = RingAttention(block.attention.core.sliding_window, cp_group)
