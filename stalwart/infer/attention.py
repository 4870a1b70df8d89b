"""Attention over a paged KV cache, swapped into Stalwart's own model in place of ``Attention.core``.

The model is not changed: ``Attention.forward`` projects q/k/v, applies RoPE at the positions it is
given, and calls ``self.core(q, k, v, positions)``. The engine runs the model on one flat stream of
tokens (every sequence's new tokens side by side, batch 1) and replaces each layer's ``core`` with a
``PagedAttention`` that writes the new keys and values into cache slots and lets each sequence's
queries attend to that sequence's cached context only.

The cache is read in place, never copied into a padded batch, whenever a sequence's blocks are
consecutive (the block pool places a sequence so they usually are): its keys are then a view of the
cache. Sequences decoding one token whose contexts start at evenly spaced slots (a batch admitted
together) are attended in one call over a strided view of the cache; a prompt with nothing cached
attends to its own new keys, and prompts of equal length side by side in the stream share one call.
Only a sequence whose blocks are scattered (a reused prefix, or a cache full enough that no
consecutive block was free) has its context gathered, alone.

How a step's decodes are attended is its *mode* (``decode_mode``): ``grouped`` is the above (no
padding: fastest on the host); ``batched`` attends every sequence decoding one token in one call per
layer, whatever their placement: over one strided view when one holds them all, else over their blocks
gathered into one padded (count, kv_heads, blocks x block_size, head_dim) tensor with a length mask (an
accelerator's step is bound by the host launching one call per group otherwise); ``alone`` (the
engine's bitwise mode) attends each sequence on its own, with exactly the tensor shapes it would have
if it ran alone, so its attention does not depend on the batch. Everything a step's layers share
(slots, index tensors, masks) is built once per step, in the layout; masks are additive (0 or -inf).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.models.llama import sliding_window_mask
from stalwart.runtime.device import is_accelerator


def decode_mode(setting: str, pad_rows: int, device: torch.device) -> str:
    """The layout mode of an engine's steps from ``engine.decode_attention``: ``alone`` in bitwise mode
    (``pad_rows`` > 1); ``auto`` is ``batched`` on an accelerator and ``grouped`` on the host."""
    if pad_rows > 1:
        return "alone"
    if setting == "auto":
        return "batched" if is_accelerator(device) else "grouped"
    return setting


@dataclass
class Span:
    """One sequence's new tokens, attended on their own."""

    q_start: int  # offset of its new tokens in the flat stream
    q_len: int  # new tokens (1 when decoding)
    ctx: int  # context length, new tokens included
    start: int = -1  # first cache slot of its context when its blocks are consecutive, else -1
    context: torch.Tensor | None = None  # (ctx,) cache slots of a scattered context
    mask: torch.Tensor | None = None  # (q_len, ctx) over the keys, where not all or causal

    @property
    def fresh(self) -> bool:
        """Nothing cached before these tokens: they attend to their own new keys and values."""
        return self.q_len == self.ctx


@dataclass
class Prefills:
    """``count`` prompts of ``q_len`` tokens each with nothing cached, back to back in the stream from
    ``q_start``: one causal call over a (count, heads, q_len, head_dim) view of the stream."""

    q_start: int
    q_len: int
    count: int
    mask: torch.Tensor | None = None  # (q_len, q_len), a sliding window shorter than the prompts


@dataclass
class Decodes:
    """Sequences decoding one token each, attended in one call over (count, kv_heads, ctx, head_dim) keys.

    Grouped: their contexts start at evenly spaced cache slots ``start``, ``start + stride``, ...; the keys
    are a strided view of the cache, a shorter context's view running on into the next one's slots.
    Batched (``table`` set): their blocks are gathered, each row padded with its last block to ``ctx``.
    Keys past a row's context (and outside a sliding window) are masked."""

    rows: torch.Tensor | slice  # their tokens' offsets in the stream
    count: int
    ctx: int  # keys per row: the longest context (grouped) or the widest block table (batched)
    mask: torch.Tensor | None  # (count, 1, 1, ctx) over each row's keys; None: it sees all
    start: int = 0
    stride: int = 0
    table: torch.Tensor | None = None  # (count, blocks) block tables, when batched
    context: torch.Tensor | None = None  # (count * ctx,) cache slots of contexts of one length (bitwise mode)


@dataclass
class StepLayout:
    slots: torch.Tensor  # (tokens,) cache slot of each new token
    block_size: int = 0
    spans: list[Span] = field(default_factory=list)
    prefills: list[Prefills] = field(default_factory=list)
    decodes: list[Decodes] = field(default_factory=list)


def build_layout(spans: list[tuple[int, int, int, list[int]]], block_size: int, num_slots: int, mode: str,
                 device: torch.device, window: int = 0, dtype: torch.dtype = torch.float32) -> StepLayout:
    """The attention layout of a step from its spans (q_start, q_len, ctx_len, block table) over a
    cache of ``num_slots`` slots, in ``mode`` (``decode_mode``), for a model with sliding ``window``
    (0: none) computing in ``dtype`` (its masks are additive, in that dtype: what SDPA would make of a
    boolean mask in every call).

    Host work only (plain lists) until the few index tensors and masks are made at the end.
    """
    bs = block_size
    group = mode != "alone"
    slots: list[int] = []
    singles: list[Span] = []
    decodes: list[tuple[int, int, int]] = []  # (start slot, stream row, ctx)
    batched: list[tuple[int, int, list[int]]] = []  # (stream row, ctx, block table)
    for q_start, q_len, ctx, blocks in spans:
        nb = -(-ctx // bs)
        b0 = blocks[0]
        first = ctx - q_len
        if mode == "batched" and q_len == 1:
            batched.append((q_start, ctx, blocks[:nb]))
        if blocks[:nb] == list(range(b0, b0 + nb)):
            start = b0 * bs
            slots.extend(range(start + first, start + ctx))
            if group and q_len == 1:
                decodes.append((start, q_start, ctx))
            else:
                singles.append(Span(q_start, q_len, ctx, start))
        elif mode == "batched" and q_len == 1:  # scattered: the batched call gathers its blocks
            slots.append(blocks[nb - 1] * bs + (ctx - 1) % bs)
        else:
            table = torch.tensor(blocks[:nb], dtype=torch.long)
            context = (table[:, None] * bs + torch.arange(bs)).flatten()[:ctx]
            slots.extend(context[first:].tolist())
            singles.append(Span(q_start, q_len, ctx, context=context.to(device)))
    layout = StepLayout(torch.tensor(slots, dtype=torch.long, device=device), bs)
    runs = _decode_runs(decodes, num_slots)
    if batched and (len(batched) > len(decodes) or len(runs) > 1):  # one call; a strided view if one holds all
        _batch_decodes(layout, batched, bs, window, device)
    else:
        _group_decodes(layout, runs, window, device)
    if group:
        _group_prefills(layout, singles, window)
    else:
        layout.spans = _equal_decodes(layout, singles, window, device)
    for s in layout.spans:  # masks, once for every layer
        if 0 < window < s.ctx or not (s.q_len == 1 or s.fresh):
            k_pos = torch.arange(s.ctx)
            s.mask = sliding_window_mask(k_pos[s.ctx - s.q_len:], k_pos, window)
    for piece in (*layout.spans, *layout.prefills, *layout.decodes):
        if piece.mask is not None:  # boolean (keys allowed) -> additive (0 or -inf), on the device
            piece.mask = torch.zeros(piece.mask.shape, dtype=dtype).masked_fill_(~piece.mask, -torch.inf).to(device)
    return layout


def _stream_rows(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    """Stream offsets as a slice when consecutive (a view), else an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def _decode_mask(lengths: list[int], ctx: int, window: int) -> torch.Tensor | None:
    """(count, 1, 1, ctx): the keys a query at the end of each context of ``lengths`` may see; None when
    every row sees all ``ctx`` keys."""
    if min(lengths) == ctx and not 0 < window < ctx:
        return None
    last = torch.tensor(lengths) - 1
    return sliding_window_mask(last, torch.arange(ctx), window)[:, None, None, :]


def _batch_decodes(layout: StepLayout, batched: list[tuple[int, int, list[int]]], bs: int, window: int,
                   device: torch.device) -> None:
    """Every decode in one call: block tables padded with their last block to the widest."""
    width = max(len(blocks) for _, _, blocks in batched)
    table = [blocks + blocks[-1:] * (width - len(blocks)) for _, _, blocks in batched]
    layout.decodes.append(Decodes(
        _stream_rows([r for r, _, _ in batched], device), len(batched), width * bs,
        _decode_mask([c for _, c, _ in batched], width * bs, window),
        table=torch.tensor(table, dtype=torch.long, device=device)))


def _decode_runs(decodes: list[tuple[int, int, int]], num_slots: int) -> list[list[tuple[int, int, int]]]:
    """The decodes (start slot, stream row, ctx), in cache order, cut into runs of evenly spaced starts."""
    decodes.sort()
    runs = []
    i = 0
    while i < len(decodes):
        j = i + 1
        if j < len(decodes):
            stride = decodes[j][0] - decodes[i][0]
            while j + 1 < len(decodes) and decodes[j + 1][0] - decodes[j][0] == stride:
                j += 1
            j += 1
        run = decodes[i:j]
        while len(run) > 1 and run[-1][0] + max(c for _, _, c in run) > num_slots:
            j -= 1  # the strided view would run past the cache's end: the last one goes alone
            run.pop()
        i = j
        runs.append(run)
    return runs


def _group_decodes(layout: StepLayout, runs: list[list[tuple[int, int, int]]], window: int,
                   device: torch.device) -> None:
    """One call per run of decodes over a strided view of the cache; a run of one is a Span."""
    for run in runs:
        if len(run) == 1:
            start, row, ctx = run[0]
            layout.spans.append(Span(row, 1, ctx, start))
            continue
        lengths = [c for _, _, c in run]
        longest = max(lengths)
        layout.decodes.append(Decodes(
            _stream_rows([r for _, r, _ in run], device), len(run), longest,
            _decode_mask(lengths, longest, window), run[0][0], run[1][0] - run[0][0]))


def _equal_decodes(layout: StepLayout, singles: list[Span], window: int, device: torch.device) -> list[Span]:
    """Bitwise mode: decodes whose contexts are equally long share one call over their gathered keys,
    each row with the very shape it has alone (no padding, no mask), so with the same bits (a batch of
    such calls computes each row as the row alone does: tests/test_infer_engine.py). The spans left."""
    alike: dict[int, list[Span]] = {}
    rest = []
    for s in singles:
        if s.q_len == 1 and not s.fresh and not 0 < window < s.ctx:
            alike.setdefault(s.ctx, []).append(s)
        else:
            rest.append(s)
    for ctx, group in alike.items():
        if len(group) == 1:
            rest += group
            continue
        slots = torch.cat([s.context if s.context is not None else torch.arange(s.start, s.start + ctx, device=device)
                           for s in group])
        layout.decodes.append(Decodes(_stream_rows([s.q_start for s in group], device), len(group), ctx, None,
                                      context=slots))
    return rest


def _group_prefills(layout: StepLayout, singles: list[Span], window: int) -> None:
    """Fresh prompts of equal length next to each other in the stream share one call."""
    i = 0
    while i < len(singles):
        s = singles[i]
        j = i + 1
        if s.fresh:
            while (j < len(singles) and singles[j].fresh and singles[j].q_len == s.q_len
                   and singles[j].q_start == s.q_start + (j - i) * s.q_len):
                j += 1
        if j - i > 1:
            pos = torch.arange(s.q_len)
            mask = sliding_window_mask(pos, pos, window) if 0 < window < s.q_len else None
            layout.prefills.append(Prefills(s.q_start, s.q_len, j - i, mask))
        else:
            layout.spans.append(s)
        i = j


class StepContext:
    """The layout of the forward pass in progress, shared by every layer's ``PagedAttention``."""

    def __init__(self) -> None:
        self.layout: StepLayout | None = None

    @contextlib.contextmanager
    def use(self, layout: StepLayout):
        self.layout = layout
        try:
            yield
        finally:
            self.layout = None


class KVCache:
    """One layer's keys and values: (slots, kv_heads, head_dim) each, slots = blocks x block_size."""

    def __init__(self, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        # Zeroed: a strided decode view reads (and masks) slots past a shorter context, which must hold
        # finite values.
        self.k = torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def run(self, start: int, stride: int, count: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``count`` contexts of ``ctx`` slots from ``start``, ``stride`` apart, as
        (count, kv_heads, ctx, head_dim) views of the cache (no copy)."""
        if start + (count - 1) * stride + ctx > self.k.shape[0]:
            raise IndexError("a cache view past the end of the cache")
        row = self.k.stride(0)
        size, strides = (count, ctx, *self.k.shape[1:]), (stride * row, row, *self.k.stride()[1:])
        kk = self.k.as_strided(size, strides, self.k.storage_offset() + start * row)
        vv = self.v.as_strided(size, strides, self.v.storage_offset() + start * row)
        return kk.transpose(1, 2), vv.transpose(1, 2)

    def gather(self, table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the blocks of ``table`` (count, blocks), each row's in order, as
        (count, kv_heads, blocks * block_size, head_dim) copies."""
        count, width = table.shape
        blocks = (-1, block_size, *self.k.shape[1:])
        rows = (count, width * block_size, *self.k.shape[1:])
        kk = self.k.view(blocks).index_select(0, table.flatten()).view(rows)
        vv = self.v.view(blocks).index_select(0, table.flatten()).view(rows)
        return kk.transpose(1, 2), vv.transpose(1, 2)


class PagedAttention(nn.Module):
    def __init__(self, cache: KVCache, step: StepContext) -> None:
        super().__init__()
        self.cache = cache
        self.step = step  # its layout holds every mask (a sliding window's too)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # q: (1, heads, tokens, head_dim); k, v: (1, kv_heads, tokens, head_dim) — local heads under TP.
        layout = self.step.layout
        assert layout is not None, "PagedAttention runs only inside an engine step"
        kc, vc = self.cache.k, self.cache.v
        kc.index_copy_(0, layout.slots, k[0].transpose(0, 1).to(kc.dtype))
        vc.index_copy_(0, layout.slots, v[0].transpose(0, 1).to(vc.dtype))
        gqa = q.shape[1] != k.shape[1]
        if not layout.spans and not layout.prefills and len(layout.decodes) == 1:
            group = layout.decodes[0]
            if isinstance(group.rows, slice) and group.rows == slice(0, q.shape[2]):  # decodes only, in order:
                # the output as it comes, no copy into place
                return self._decode(q, group, gqa).transpose(0, 1).unsqueeze(0)
        out = torch.empty_like(q)
        for group in layout.decodes:
            self._decodes(q, out, group, gqa)
        for group in layout.prefills:
            self._prefills(q, k, v, out, group, gqa)
        for span in layout.spans:
            self._span(q, k, v, out, span, gqa)
        return out

    def _span(self, q, k, v, out, span: Span, gqa: bool) -> None:
        a, b = span.q_start, span.q_start + span.q_len
        qq = q[:, :, a:b]
        ctx = span.ctx
        if span.fresh:  # nothing cached before: its own new keys, as the stream holds them
            kk, vv = k[:, :, a:b].to(self.cache.k.dtype), v[:, :, a:b].to(self.cache.v.dtype)
        elif span.context is None:  # consecutive blocks: a view of the cache
            kk, vv = self.cache.run(span.start, 0, 1, ctx)
        else:  # scattered blocks: gathered (index_select is several times faster than indexing on CPU)
            kc, vc = self.cache.k, self.cache.v
            kk = kc.index_select(0, span.context).transpose(0, 1).unsqueeze(0)  # (1, kv_heads, ctx, head_dim)
            vv = vc.index_select(0, span.context).transpose(0, 1).unsqueeze(0)
        if span.mask is not None:
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=span.mask, enable_gqa=gqa)
        else:  # one query sees every key; several are a fresh prompt's, causal
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=span.q_len > 1, enable_gqa=gqa)
        out[:, :, a:b] = o

    def _prefills(self, q, k, v, out, group: Prefills, gqa: bool) -> None:
        a, n, L = group.q_start, group.count, group.q_len

        def batched(t: torch.Tensor) -> torch.Tensor:  # (1, h, n*L, d) -> (n, h, L, d), a view
            return t[0, :, a:a + n * L].unflatten(1, (n, L)).transpose(0, 1)

        qq, kk, vv = batched(q), batched(k).to(self.cache.k.dtype), batched(v).to(self.cache.v.dtype)
        if group.mask is not None:
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=group.mask, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa)
        out[0, :, a:a + n * L] = o.transpose(0, 1).flatten(1, 2)

    def _decodes(self, q, out, group: Decodes, gqa: bool) -> None:
        out[0, :, group.rows] = self._decode(q, group, gqa).transpose(0, 1)

    def _decode(self, q, group: Decodes, gqa: bool) -> torch.Tensor:
        """The group's attention output, (count, heads, head_dim)."""
        qq = q[0, :, group.rows].transpose(0, 1)  # (count, heads, head_dim)
        if group.context is not None:  # as each row's own call would gather its keys
            shape = (group.count, group.ctx, *self.cache.k.shape[1:])
            kk = self.cache.k.index_select(0, group.context).view(shape).transpose(1, 2)
            vv = self.cache.v.index_select(0, group.context).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(qq.unsqueeze(2), kk, vv, enable_gqa=gqa)
        elif group.table is None:
            kk, vv = self.cache.run(group.start, group.stride, group.count, group.ctx)
            o = F.scaled_dot_product_attention(qq.unsqueeze(2), kk, vv, attn_mask=group.mask, enable_gqa=gqa)
        else:
            kk, vv = self.cache.gather(group.table, self.step.layout.block_size)
            # The query heads that share a key head are its queries: (count, kv_heads, heads / kv_heads,
            # head_dim) against the keys as stored, no expansion (one query token: no causal mask among them).
            qq = qq.reshape(group.count, kk.shape[1], -1, qq.shape[-1])
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=group.mask)
        return o.flatten(1, 2)


def install_paged_attention(model: nn.Module, caches: list[KVCache], step: StepContext) -> None:
    """Replace every layer's attention kernel with one reading and writing ``caches``."""
    for cache, layer in zip(caches, model.layers.values()):
        layer.attention.core = PagedAttention(cache, step)
