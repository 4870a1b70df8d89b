"""Continuous batching: which tokens of which sequences the next forward pass computes.

Every engine step the scheduler builds one batch under a token budget:
1. sequences already running go first, in admission order: one token each when decoding, or the next
   chunk of their prompt when a long prompt is being prefilled in pieces (chunked prefill; chunks end
   at multiples of the budget, so a prompt is cut the same way whatever shares its steps);
2. then waiting requests are admitted first come, first served while the budget, the sequence limit
   and the KV cache allow, each first mapping whatever prefix of its prompt is already cached.

When the cache runs out, the most recently admitted running sequence is preempted: its blocks are
released and it goes back to the front of the queue with every token it has so far; it is recomputed
when readmitted (usually from its own still-cached blocks). Requests join and leave between steps, so
a new request never waits for a batch to drain. Pure logic: no tensors, no clocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from stalwart.infer.blocks import BlockPool, block_digest


@dataclass
class Sequence:
    rid: str
    tokens: list[int]  # prompt, then every generated token
    prompt_len: int
    max_total: int  # prompt + max new tokens: the cache this sequence may need
    computed: int = 0  # leading tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)  # the block table
    registered: int = 0  # leading blocks already published for prefix reuse
    digest: bytes = b""  # digest of the registered blocks
    cached_prompt: int = 0  # prompt tokens served from the prefix cache at the last admission
    preemptions: int = 0
    reuse_prefix: bool = True  # False: compute every prompt token (their logits are wanted)
    # Another sequence with the same prompt (one of a request's several choices): admitted only once
    # that one's prompt is computed, so its cached blocks are mapped instead of computed again.
    follows: Sequence | None = None


@dataclass(frozen=True)
class Piece:
    """Compute ``tokens[start:start + n]`` of ``seq``; ``sample`` if that completes the sequence so far."""

    seq: Sequence
    start: int
    n: int

    @property
    def sample(self) -> bool:
        return self.start + self.n == len(self.seq.tokens)


class Scheduler:
    def __init__(self, pool: BlockPool, max_batch_tokens: int, max_seqs: int, prefix_caching: bool = True) -> None:
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preempted_total = 0
        self.cached_tokens_total = 0  # prompt tokens served from the prefix cache at admission

    def capacity_tokens(self) -> int:
        return (self.pool.num_blocks - self.pool.reserved) * self.pool.block_size

    def add(self, seq: Sequence) -> None:
        if seq.max_total > self.capacity_tokens():
            raise ValueError(f"the request needs {seq.max_total} tokens of KV cache; the whole cache holds "
                             f"{self.capacity_tokens()}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, rid: str) -> Sequence | None:
        for seq in self.waiting:
            if seq.rid == rid:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.rid == rid:
                self.finish(seq)
                return seq
        return None

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []

    def schedule(self) -> list[Piece]:
        budget = self.max_batch_tokens
        pieces: list[Piece] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq)
            if n > budget:  # the rest of a long prompt waits for a step with room for its whole chunk
                i += 1
                continue
            while not self._reserve(seq, seq.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                pieces.append(Piece(seq, seq.computed, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            lead = seq.follows
            if self.prefix_caching and lead is not None and lead.blocks and lead.computed < lead.prompt_len:
                break  # its twin is computing the shared prompt: map it next step
            if self.prefix_caching and not seq.blocks and seq.reuse_prefix:
                self._map_prefix(seq)
            n = self._chunk(seq)
            if n > budget or not self._reserve(seq, seq.computed + n):
                if not self.running and not pieces:
                    raise RuntimeError("KV cache too small for a single request")  # add() prevents this
                self._unmap(seq)
                break
            self.waiting.popleft()
            self.running.append(seq)
            self.cached_tokens_total += seq.cached_prompt
            pieces.append(Piece(seq, seq.computed, n))
            budget -= n
        return pieces

    def _chunk(self, seq: Sequence) -> int:
        """Tokens of ``seq`` to compute next: up to the next multiple of the token budget.

        Chunk boundaries depend on the sequence alone, never on what else is in the batch, so a prompt
        is cut the same way (and computed with the same shapes) whoever it shares the step with.
        """
        c = self.max_batch_tokens
        return min(len(seq.tokens), (seq.computed // c + 1) * c) - seq.computed

    def commit(self, piece: Piece) -> None:
        """The forward pass wrote ``piece``'s K/V: advance and publish newly full blocks."""
        seq = piece.seq
        seq.computed = piece.start + piece.n
        if not self.prefix_caching:
            return
        bs = self.pool.block_size
        while (seq.registered + 1) * bs <= seq.computed:
            k = seq.registered
            seq.digest = block_digest(seq.digest, seq.tokens[k * bs:(k + 1) * bs])
            self.pool.register(seq.blocks[k], seq.digest)
            seq.registered += 1

    def grow(self, seq: Sequence, upto: int) -> bool:
        """Cache blocks for the first ``upto`` tokens of a running ``seq`` now, if free blocks allow (never
        preempting): room for speculative decoding's drafts."""
        return self._reserve(seq, upto)

    # -- internals -------------------------------------------------------------------------------

    def _reserve(self, seq: Sequence, upto: int) -> bool:
        need = -(-upto // self.pool.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        # Placed so its blocks stay consecutive (attention then reads them in place): after its last
        # block, or for a new sequence where there is room for all it may grow to.
        bs = self.pool.block_size
        seq.blocks += self.pool.allocate(need, seq.blocks[-1] if seq.blocks else None, -(-seq.max_total // bs))
        return True

    def _map_prefix(self, seq: Sequence) -> None:
        # At least one token must be computed to produce the next token's logits.
        blocks, digest = self.pool.match_prefix(seq.tokens, (len(seq.tokens) - 1) // self.pool.block_size)
        seq.blocks, seq.digest, seq.registered = blocks, digest, len(blocks)
        seq.computed = len(blocks) * self.pool.block_size
        seq.cached_prompt = min(seq.computed, seq.prompt_len)

    def _unmap(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.digest, seq.registered, seq.computed = [], b"", 0, 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._unmap(seq)
        seq.preemptions += 1
        self.preempted_total += 1
        self.waiting.appendleft(seq)
