"""Bit-exact integer sums of tensors and of their pieces, for the state fingerprint (``fingerprint.py``).

A tensor's bytes are read as little-endian 64-bit words laid over the *whole* tensor's flat order and
summed modulo 2**64 on the tensor's own device, never converted (one vectorised pass over memory: an
int64 sum that wraps runs at memory speed). Equivalently an element at global flat index ``g`` of a
``b``-byte type counts as its unsigned bits times ``2**(8*b*(g mod 8/b))``, a sum over elements, so the
sums of disjoint pieces (FSDP or tensor-parallel shards, a DTensor's local tensor) add up to the whole
tensor's whatever the layout; a piece whose start is not word-aligned pays a few extra small ops at its
ends (or, sharded on an inner dimension out of step with the words, a slower exact pass). Any single
changed bit changes its word by +-2**k, k < 64, so it changes the sum.
"""

from __future__ import annotations

import torch

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
MASK = (1 << 64) - 1
_WORD = 8  # bytes per summed word


_OFFSETS: dict[tuple, tuple[str, tuple[int, ...]]] = {}  # (shape, mesh, placements) -> offset: the same every step


def piece_of(t: torch.Tensor) -> tuple[torch.Tensor, str, tuple[int, ...]]:
    """This rank's piece of ``t``, the piece's global offset as a key ("0,0" for a plain tensor) and as
    numbers."""
    if hasattr(t, "to_local"):  # a DTensor: the shard and where it sits in the whole tensor
        layout = (tuple(t.shape), id(t.device_mesh), tuple(t.placements))
        known = _OFFSETS.get(layout)
        if known is None:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, at = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            at = tuple(int(o) for o in at)
            known = _OFFSETS[layout] = (",".join(map(str, at)), at)
        return t.to_local(), known[0], known[1]
    return t, ",".join("0" * t.dim()), (0,) * t.dim()


def _unsigned_sum(ints: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Sum, modulo 2**64, of ``ints`` read as unsigned and shifted left by ``shift`` bits (small pieces)."""
    bits = ints.element_size() * 8
    wide = ints.to(torch.int64)
    if bits < 64:
        wide = wide & ((1 << bits) - 1)
    return torch.bitwise_left_shift(wide, shift).sum()


def _words(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (a whole number of words) as int64 words; copied if its memory does not start on one."""
    if (flat.storage_offset() * flat.element_size()) % _WORD:
        flat = flat.clone()
    return flat.view(torch.int64)


def int_sum(t: torch.Tensor, global_shape: tuple[int, ...] | None = None,
            offset: tuple[int, ...] | None = None) -> torch.Tensor:
    """The sum, modulo 2**64, of the 64-bit words that ``t``'s bytes form in the flat order of the
    whole tensor it is a piece of (``global_shape``, ``t`` at ``offset``; by default ``t`` is the whole
    tensor), as an int64 0-d tensor on its device. The sums of disjoint pieces add up to the whole's."""
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
        global_shape = None if global_shape is None else (*global_shape, 2)
        offset = None if offset is None else (*offset, 0)
    shape = tuple(t.shape)
    global_shape = shape if global_shape is None else tuple(global_shape)
    offset = (0,) * len(shape) if offset is None else tuple(offset)
    flat = t.contiguous().view(_INT_VIEW[t.element_size()]).reshape(-1)
    plan = _plans.get((shape, global_shape, offset, flat.element_size(), flat.device))
    if plan is None:
        plan = _plans[(shape, global_shape, offset, flat.element_size(), flat.device)] = _plan(
            shape, global_shape, offset, flat.element_size(), flat.device)
    head, body, shifts = plan
    total = _words(flat[head:head + body]).sum()
    if shifts is not None:  # the elements outside whole words: unsigned, shifted to their place in a word
        rest = flat if body == 0 else torch.cat([flat[:head], flat[head + body:]])
        total = total + _unsigned_sum(rest, shifts)
    return total


_plans: dict[tuple, tuple[int, int, torch.Tensor | None]] = {}  # a piece's layout -> how to sum it


def _plan(shape, global_shape, offset, size: int, device) -> tuple[int, int, torch.Tensor | None]:
    """How ``int_sum`` sums a piece: (head, body, shifts): the elements ``head:head+body`` are whole
    words; every other element (in order: those before, then after) is shifted left by ``shifts`` bits."""
    per = _WORD // size  # elements per word
    numel = 1
    for n in shape:
        numel *= n
    if per == 1 or (shape and shape[-1] % per == 0 and offset[-1] % per == 0 and global_shape[-1] % per == 0):
        return 0, numel, None  # every row starts on a word: the words are the piece's own
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    # One run of the global order when the piece spans every dimension after the first it cuts, and
    # only one index of those before it.
    cut = next((d for d in range(len(shape)) if shape[d] != global_shape[d]), len(shape))
    if cut == len(shape) or (all(shape[d] == 1 for d in range(cut))
                             and all(shape[d] == global_shape[d] for d in range(cut + 1, len(shape)))):
        start = sum(o * s for o, s in zip(offset, strides))
        head = min((-start) % per, numel)
        body = (numel - head) // per * per
        where = torch.cat([torch.arange(start, start + head), torch.arange(start + head + body, start + numel)])
    else:  # sharded on an inner dimension, out of step with the words: each element's place from its index
        head = body = 0
        where = torch.zeros((), dtype=torch.int64)
        for d in range(len(shape)):
            where = where.unsqueeze(-1) + (torch.arange(shape[d]) + offset[d]) * strides[d]
        where = where.reshape(-1)
    return head, body, ((where % per) * (8 * size)).to(device) if where.numel() else None


def piece_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``piece_sum`` of each tensor, as one int64 vector on their device. Plain one-element tensors
    (AdamW's step counters: one per parameter) are read together, a few ops for all of them: such a
    tensor's value is its one element's bits, unsigned."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    single: dict[int, list[int]] = {}  # element size -> indices of one-element plain tensors
    for i, t in enumerate(tensors):
        if type(t) is torch.Tensor and t.numel() == 1 and not t.is_complex() and t.dtype != torch.bool:
            single.setdefault(t.element_size(), []).append(i)
        else:
            out[i] = piece_sum(t)
    for size, idx in single.items():
        view = _INT_VIEW[size]
        bits = torch.stack([tensors[i].detach().reshape(()).view(view) for i in idx]).to(torch.int64)
        if size < _WORD:
            bits = bits & ((1 << (8 * size)) - 1)
        for j, i in enumerate(idx):
            out[i] = bits[j]
    if not out:
        return torch.zeros(0, dtype=torch.int64)
    device = out[0].device  # the step counters may sit on the host beside an accelerator's weights
    return torch.stack([o.to(device) for o in out])


def piece_sum(t: torch.Tensor) -> torch.Tensor:
    """``int_sum`` of this rank's piece of ``t`` (a plain tensor or a DTensor), placed in the whole."""
    if (type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter) and type(t.data) is torch.Tensor) \
            and t.dim() and t.is_contiguous() and not t.is_complex() and t.dtype != torch.bool \
            and (t.shape[-1] * t.element_size()) % _WORD == 0 and (t.storage_offset() * t.element_size()) % _WORD == 0:
        return t.detach().view(torch.int64).sum()  # the common case: a whole tensor of whole words
    local, _, offset = piece_of(t)
    return int_sum(local, tuple(t.shape), offset)
