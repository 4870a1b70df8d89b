"""The KV-cache block pool: fixed-size blocks, reference counts, and prefix reuse by content hash.

The cache is ``num_blocks`` blocks of ``block_size`` token slots each (the tensors live in
``infer/attention.py``; this file only hands out block numbers). A sequence owns a list of blocks, its
*block table*; token ``i`` of the sequence lives in slot ``table[i // block_size] * block_size +
i % block_size``.

Prefix reuse: once a block is full, it is registered under a digest of *every* token up to its end
(a hash chain), so a later request whose prompt starts with the same tokens maps those blocks into its
own table instead of recomputing them. A block is shared by reference count; when no sequence uses it,
it goes to the back of the free list but keeps its content and digest, so it can still be reused until
it is actually handed out again (least recently freed first).

Placement: attention reads a sequence's context in place when its blocks are consecutive, so a new
sequence is placed (next fit, from a cursor) where a run of free blocks can hold all it may grow to, and
each later block is the one right after its last when that one is free; sequences admitted together
thus sit at evenly spaced offsets, the layout a batched decode reads as one strided view. Only when no
such run or neighbour is free are blocks taken least recently freed first (a sequence's blocks are then
scattered, and gathered when attended). NOTE: a placement may hand out a freed block that still holds a
cached prefix before an older one; prefix reuse then misses a little earlier than strict LRU would.
Pure logic: no tensors, no clocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict


def block_digest(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """Digest of a full block given the digest of everything before it (b'' for the first block)."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.digest_of: dict[int, bytes] = {}
        self.by_digest: dict[bytes, int] = {}
        self.reserved = 0  # blocks taken for good (never given to a sequence)
        self.cursor = 0  # where the next placement's search starts

    @property
    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free)

    def can_allocate(self, n: int) -> bool:
        return len(self.free) >= n

    def allocate(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        """``n`` fresh blocks; the caller checks ``can_allocate``.

        ``after``: the sequence's last block, whose successors are taken if free; for a new sequence the
        first ``n`` of a free run of ``room`` blocks, all it may grow to. Else a free run of ``n`` past the
        cursor, else the least recently freed blocks.
        """
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self.free)} free")
        start = after + 1 if after is not None and self._is_free_run(after + 1, n) else None
        if start is None and after is None and room > n:
            start = self._find_run(room)
        if start is None:
            start = self._find_run(n)
        if start is not None:
            blocks = list(range(start, start + n))
            for block in blocks:
                del self.free[block]
        else:
            blocks = [self.free.popitem(last=False)[0] for _ in range(n)]
        for block in blocks:
            old = self.digest_of.pop(block, None)
            if old is not None and self.by_digest.get(old) == block:
                del self.by_digest[old]
            self.refs[block] = 1
        return blocks

    def _is_free_run(self, start: int, n: int) -> bool:
        return start + n <= self.num_blocks and all(b in self.free for b in range(start, start + n))

    def _find_run(self, n: int) -> int | None:
        """The first block of a run of ``n`` free blocks, searching from the cursor (wrapping once), and
        move the cursor past the run; None if there is none."""
        if n > len(self.free):
            return None
        for lo, hi in ((self.cursor, self.num_blocks), (0, min(self.num_blocks, self.cursor + n - 1))):
            run = 0
            for b in range(lo, hi):
                run = run + 1 if b in self.free else 0
                if run == n:
                    self.cursor = (b + 1) % self.num_blocks
                    return b + 1 - n
        return None

    def reserve(self) -> int:
        """A block taken out of circulation for good (scratch space)."""
        self.reserved += 1
        return self.allocate(1)[0]

    def release(self, blocks: list[int]) -> None:
        # Freed in reverse so a sequence's first blocks (the most shareable prefix) are evicted last.
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def match_prefix(self, tokens: list[int], max_blocks: int) -> tuple[list[int], bytes]:
        """Cached blocks holding the longest prefix of ``tokens`` (at most ``max_blocks`` full blocks).

        Takes a reference on each returned block. Returns (blocks, digest of the matched prefix).
        """
        bs = self.block_size
        digest, blocks = b"", []
        for i in range(min(max_blocks, len(tokens) // bs)):
            d = block_digest(digest, tokens[i * bs:(i + 1) * bs])
            block = self.by_digest.get(d)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.free[block]
            self.refs[block] += 1
            blocks.append(block)
            digest = d
        return blocks, digest

    def register(self, block: int, digest: bytes) -> None:
        """Record that ``block`` is full and holds the tokens that ``digest`` names."""
        if digest not in self.by_digest:
            self.by_digest[digest] = block
            self.digest_of[block] = digest
