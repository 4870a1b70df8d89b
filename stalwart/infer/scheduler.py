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

Latency classes: every sequence has a ``priority`` (lower runs first, vLLM's convention; default 0).
The queue and the running list are kept in (priority, arrival) order, so a better class is admitted,
given the step's budget, and spared from preemption first. While a sequence of a better class than some
running one has a prompt to compute (waiting, or prefilling in chunks), a step runs that class and the
better ones only: the worse classes keep their blocks and wait that step (their prefill chunks and
decodes would make the step slower), and one is preempted (recomputed later) when the better request
needs its sequence slot or its cache blocks. With one class (every request at 0) nothing changes.
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
    priority: int = 0  # latency class: lower runs first
    handoff: bool = False  # ends after its first token, handed to another engine (infer/handoff.py)
    order: int = 0  # arrival number (Scheduler.add): first come, first served within a class

    @property
    def rank(self) -> tuple[int, int]:
        return self.priority, self.order


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
        self.arrivals = 0

    def capacity_tokens(self) -> int:
        return (self.pool.num_blocks - self.pool.reserved) * self.pool.block_size

    def add(self, seq: Sequence) -> None:
        if seq.max_total > self.capacity_tokens():
            raise ValueError(f"the request needs {seq.max_total} tokens of KV cache; the whole cache holds "
                             f"{self.capacity_tokens()}")
        self.arrivals += 1
        seq.order = self.arrivals
        self._queue(seq)

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
        cutoff = self._cutoff()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq)
            if n > budget or (cutoff is not None and seq.priority > cutoff):
                i += 1  # the rest of a long prompt waits for a step with room for its chunk; a worse class
                continue  # waits while a better one prefills
            while not self._reserve(seq, seq.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                pieces.append(Piece(seq, seq.computed, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if cutoff is not None and seq.priority > cutoff:
                break
            if len(self.running) >= self.max_seqs and not self._make_room(seq):
                break
            lead = seq.follows
            if self.prefix_caching and lead is not None and lead.blocks and lead.computed < lead.prompt_len:
                break  # its twin is computing the shared prompt: map it next step
            if self.prefix_caching and not seq.blocks and seq.reuse_prefix:
                self._map_prefix(seq)
            n = self._chunk(seq)
            while n <= budget and not self._reserve(seq, seq.computed + n) and self._make_room(seq):
                pass  # a worse class gave its blocks back
            if n > budget or not self._reserve(seq, seq.computed + n):
                if not self.running and not pieces:
                    raise RuntimeError("KV cache too small for a single request")  # add() prevents this
                self._unmap(seq)
                break
            self.waiting.popleft()
            self._run(seq)
            self.cached_tokens_total += seq.cached_prompt
            pieces.append(Piece(seq, seq.computed, n))
            budget -= n
        return pieces

    def _cutoff(self) -> int | None:
        """The class a step is held to: the best class with a prompt to compute, when some running
        sequence is of a worse one; None when every class may run."""
        prefilling = [s.priority for s in self.running if s.computed < len(s.tokens) - 1]
        urgent = min(prefilling + [self.waiting[0].priority] if self.waiting else prefilling, default=None)
        if urgent is None or not self.running or self.running[-1].priority <= urgent:
            return None
        return urgent

    def _make_room(self, seq: Sequence) -> bool:
        """Preempt the worst-class running sequence (latest admitted) if it is of a worse class than
        ``seq``; whether one was."""
        if not self.running or self.running[-1].priority <= seq.priority:
            return False
        self._preempt(self.running[-1])
        return True

    def _queue(self, seq: Sequence) -> None:
        """Into the queue in (priority, arrival) order: a preempted sequence goes back before later ones."""
        at = len(self.waiting)
        while at > 0 and self.waiting[at - 1].rank > seq.rank:
            at -= 1
        self.waiting.insert(at, seq)

    def _run(self, seq: Sequence) -> None:
        """Into the running list after every sequence of its class or a better one."""
        at = len(self.running)
        while at > 0 and self.running[at - 1].priority > seq.priority:
            at -= 1
        self.running.insert(at, seq)

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

    def preempt_all(self) -> None:
        """Send every running sequence back to the queue, in admission order, to be recomputed (its cached
        keys and values are lost: a process of the replica was started again with an empty cache)."""
        for seq in reversed(list(self.running)):
            self._preempt(seq)

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
        self._queue(seq)
