"""The KV-cache block pool: fixed-size blocks, reference counts, and prefix reuse by content hash.

The cache is ``num_blocks`` blocks of ``block_size`` token slots each (the tensors live in
``infer/attention.py``; this file only hands out block numbers). A sequence owns a list of blocks, its
*block table*; token ``i`` of the sequence lives in slot ``table[i // block_size] * block_size +
i % block_size``.

Prefix reuse: once a block is full, it is registered under a digest of *every* token up to its end
(a hash chain), so a later request whose prompt starts with the same tokens maps those blocks into its
own table instead of recomputing them. A block is shared by reference count; when no sequence uses it,
it goes to the back of the free list but keeps its content and digest, so it can still be reused until
it is actually handed out again (least recently freed first). Pure logic: no tensors, no clocks.
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

    @property
    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free)

    def can_allocate(self, n: int) -> bool:
        return len(self.free) >= n

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (the least recently freed first); the caller checks ``can_allocate``."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            old = self.digest_of.pop(block, None)
            if old is not None and self.by_digest.get(old) == block:
                del self.by_digest[old]
            self.refs[block] = 1
            out.append(block)
        return out

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
