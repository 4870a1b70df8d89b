"""The model's fused projections and rotary embedding, with hand-written backward passes where they save work.

The attention's q/k/v projections and the feed-forward's gate/up projections each run as one matmul over
their concatenated weights (the input is read once; one larger GEMM beats several small ones). Autograd
would then split the output and, in the backward, join the pieces' gradients again with ``torch.cat``: a
copy of the whole projection output per layer and projection (about 5 % of an eager CPU step of the
reference model). Here the training path's backward writes each piece's gradient straight into its place
in one tensor, with the very operations autograd runs for the plain expressions (the same values, the
same bits: tests/test_model.py), so nothing is joined:

- ``project_qkv``: the packed projection, then RoPE on q and k (``RotaryQKV``);
- ``swiglu``: the packed projection, then ``silu(gate) * up`` (``SwiGLU``).

Weights that are tensor subclasses (a tensor-parallel DTensor shard) keep one module per projection;
under ``torch.compile`` and without gradients the plain expressions run (the compiler fuses them itself).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

_HAND_WRITTEN = [True]  # off only inside ``plain_autograd`` (tests compare the two)


@contextlib.contextmanager
def plain_autograd():
    """Run the training path with autograd's own backward (of the weights' concatenation, the split, RoPE
    and SwiGLU): the reference the hand-written backward passes are tested against."""
    _HAND_WRITTEN[0] = False
    try:
        yield
    finally:
        _HAND_WRITTEN[0] = True


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x[2i], x[2i+1]) by position-dependent angles, as one complex multiply.

    x: (batch, seq, heads, head_dim); rope: (seq, head_dim/2, 2) holding (cos, sin).
    """
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (b, s, h, d/2)
    return torch.view_as_real(xc * _freqs(rope)).flatten(-2).type_as(x)


def _freqs(rope: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(rope.float().contiguous()).unsqueeze(1)  # (s, 1, d/2)


def plain_weights(*weights: torch.Tensor) -> bool:
    """Whether these weights are ordinary tensors (one device, or FSDP's gathered copies), so their
    projections may run as one matmul. A tensor subclass (a tensor-parallel DTensor shard, whose module
    hooks redistribute its input and output) keeps the per-module path."""
    return all(type(w) in (torch.Tensor, nn.Parameter) for w in weights)


def _hand_written(weights: list[torch.Tensor]) -> bool:
    return (_HAND_WRITTEN[0] and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and plain_weights(*weights))


def fused_linear(x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """``tuple(lin(x) for lin in linears)`` as one matmul over the concatenated weights when they are
    plain tensors. Weights that ``pack_fused_weights`` laid back to back are used as they lie (the same
    values as their concatenation, without copying them every call), with or without gradients."""
    weights = [lin.weight for lin in linears]
    if not plain_weights(*weights):
        return tuple(lin(x) for lin in linears)
    rows = [w.shape[0] for w in weights]
    if torch.compiler.is_compiling() or not _HAND_WRITTEN[0]:  # the compiler sees through the concatenation
        # (and not storage pointers); plain_autograd's reference is autograd's own
        return F.linear(x, torch.cat(weights)).split(rows, dim=-1)
    if not torch.is_grad_enabled():
        packed = back_to_back(weights)
        return F.linear(x, torch.cat(weights) if packed is None else packed).split(rows, dim=-1)
    return _PackedLinear.apply(x, *weights).split(rows, dim=-1)


def project_qkv(x: torch.Tensor, linears: tuple[nn.Linear, nn.Linear, nn.Linear], rope: torch.Tensor,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as (batch, seq, heads, head_dim), q and k rotated by ``rope`` (seq, head_dim/2, 2)."""
    weights = [lin.weight for lin in linears]
    bs, seq, _ = x.shape
    if _hand_written(weights):
        return RotaryQKV.apply(_PackedLinear.apply(x, *weights), rope, [w.shape[0] for w in weights], head_dim)
    q, k, v = (t.view(bs, seq, -1, head_dim) for t in fused_linear(x, linears))
    return apply_rope(q, rope), apply_rope(k, rope), v


def swiglu(x: torch.Tensor, gate: nn.Linear, up: nn.Linear) -> torch.Tensor:
    """``silu(gate(x)) * up(x)``."""
    weights = [gate.weight, up.weight]
    if _hand_written(weights):
        return SwiGLU.apply(_PackedLinear.apply(x, *weights), weights[0].shape[0])
    g, u = fused_linear(x, (gate, up))
    return F.silu(g) * u


class RotaryQKV(torch.autograd.Function):
    """The packed q/k/v projection's output -> (RoPE(q), RoPE(k), v). The backward writes RoPE's input
    gradients (autograd's: the output gradient times the conjugate rotation) and v's gradient into one
    tensor laid out like the projection's output."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, rope: torch.Tensor, rows: list[int], head_dim: int):
        q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split(rows, dim=-1))
        ctx.rows = rows
        ctx.save_for_backward(rope)
        return apply_rope(q, rope), apply_rope(k, rope), v

    @staticmethod
    def backward(ctx, gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor):
        (rope,) = ctx.saved_tensors
        given = next(g for g in (gq, gk, gv) if g is not None)
        grad = _unfilled(given, *given.shape[:2], sum(ctx.rows))
        freqs = _freqs(rope).conj()
        for g, into in zip((gq, gk, gv), grad.split(ctx.rows, dim=-1)):
            if g is None:
                into.zero_()
            elif g is gv:
                into.copy_(g.flatten(-2))
            else:
                gc = torch.view_as_complex(g.float().reshape(*g.shape[:-1], -1, 2).contiguous())
                if into.dtype == torch.float32:  # straight into place
                    torch.mul(gc, freqs, out=torch.view_as_complex(into.unflatten(-1, (*g.shape[2:3], -1, 2))))
                else:
                    into.copy_(torch.view_as_real(gc * freqs).flatten(-3))
        return grad, None, None, None


class SwiGLU(torch.autograd.Function):
    """The packed gate/up projection's output -> ``silu(gate) * up``. The backward writes the gate's and
    the up projection's gradients into one tensor laid out like the projection's output."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, hidden: int) -> torch.Tensor:
        gate, up = gate_up.split(hidden, dim=-1)
        s = F.silu(gate)
        ctx.save_for_backward(gate, up, s)
        return s * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, s = ctx.saved_tensors
        out = _unfilled(grad, *grad.shape[:-1], 2 * gate.shape[-1])
        d_gate, d_up = out.split(gate.shape[-1], dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        torch.mul(grad, s, out=d_up)
        return out, None


def _unfilled(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """A new tensor of ``like``'s kind whose every element the caller writes: deterministic mode's fill of
    new memory (``torch.utils.deterministic.fill_uninitialized_memory``, a whole extra pass) is skipped."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        return like.new_empty(shape)
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill


class _PackedLinear(torch.autograd.Function):
    """``F.linear(x, torch.cat(weights))`` with its autograd, reading back-to-back weights in place.

    The backward runs the very matmuls autograd runs for ``linear`` of a concatenation (``mm`` of the
    output's gradient with the weights; the weights' gradient as one ``mm``, split into each weight's
    rows), so the values are the same bits; only the copy of the weights is gone (weights that do not
    lie back to back are concatenated here, as before)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        packed = back_to_back(list(weights))
        if packed is None:
            packed = torch.cat(weights)
        ctx.rows = [w.shape[0] for w in weights]
        ctx.save_for_backward(x, packed)
        return F.linear(x, packed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, packed = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])  # (tokens, sum of rows)
        grad_x = grad2d.mm(packed).view(x.shape) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[1:]):
            return (grad_x,) + (None,) * len(ctx.rows)
        grad_w = grad2d.t().mm(x.reshape(-1, x.shape[-1]))  # (sum of rows, in)
        return (grad_x, *grad_w.split(ctx.rows))


def back_to_back(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The weights' concatenation along rows as a view, when they lie back to back in one storage."""
    first = weights[0]
    offset = first.storage_offset()
    for w in weights:
        if (not w.is_contiguous() or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or w.storage_offset() != offset):
            return None
        offset += w.numel()
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), first.storage_offset())
