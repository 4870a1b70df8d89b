"""The inference engine: continuous batching over a paged KV cache, on Stalwart's own model.

``Engine.step()`` is one forward pass: the scheduler picks tokens (decodes and prompt chunks), the
model computes them in one flat stream, the sequences that completed get their next token sampled,
and finished requests leave. Requests are added and aborted between steps.

With ``record_routing`` (a mixture-of-experts model), every computed token's experts are kept beside its
keys and values, per cache slot: a prefix reused from the cache brings the experts that computed it. A
finished request leaves them in ``Engine.routed`` (request id -> (positions, sparse layers, k)) for every
position it fed through the model (all its tokens but the last), what a trainer replays
(``models.moe.Routing``); the caller takes them from there.

Over several processes every rank holds the cache of its layers and heads; rank 0 owns the scheduler
and sends each step's batch to the other ranks (``infer/group.py``), which run their part of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from stalwart.config.serve import EngineConfig
from stalwart.errors import UserError
from stalwart.infer.attention import (KVCache, StepContext, StepLayout, build_layout, decode_mode,
                                      install_paged_attention)
from stalwart.infer.blocks import BlockPool
from stalwart.infer.outputs import Output, RequestError
from stalwart.generate import TokenDraws
from stalwart.infer.handoff import export_kv, fits, import_kv, slots_of
from stalwart.infer.sampling import Choice, SamplingParams, sample_rows, score_rows, stops_on
from stalwart.infer.scheduler import Piece, Scheduler, Sequence
from stalwart.infer.speculative import Drafts, build_speculator
from stalwart.infer.structured import GrammarState, Grammars
from stalwart.infer.text import TextTail
from stalwart.models.llama import pack_fused_weights
from stalwart.models.moe import Routing, route_dtype
from stalwart.runtime.device import HOST


@dataclass
class RequestState:
    seq: Sequence
    params: SamplingParams
    draws: TokenDraws  # output token i's randomness comes from draws.at(i)
    tail: TextTail
    grammar: GrammarState | None = None  # a structured output's position in its constraint
    prompt_choices: list[Choice] = field(default_factory=list)  # prompt tokens 1.. scored so far

    @property
    def generated(self) -> list[int]:
        return self.seq.tokens[self.seq.prompt_len:]


@dataclass
class Batch:
    """One forward pass, as plain lists (what rank 0 sends to the other tensor-parallel ranks)."""

    tokens: list[int]
    positions: list[int]
    spans: list[tuple[int, int, int, list[int]]]  # (q_start, q_len, ctx_len, block table)
    rows: list[int]  # stream offsets whose logits are needed

    def layout(self, block_size: int, num_slots: int, mode: str, device: torch.device, window: int,
               dtype: torch.dtype) -> StepLayout:
        """The attention layout over a cache of ``num_slots`` slots, its index tensors and masks on
        ``device`` (the cache's); ``mode`` (``attention.decode_mode``) says which sequences share calls."""
        return build_layout(self.spans, block_size, num_slots, mode, device, window, dtype)


class Engine:
    def __init__(self, model: nn.Module, tokenizer, eos_id: int | None, cfg: EngineConfig, tp_size: int = 1,
                 link=None, pipe=None, weight_version: int = 0, draft: nn.Module | None = None,
                 record_routing: bool = False) -> None:
        """``draft``: the draft model, for ``cfg.speculative = 'draft'`` (rank 0 only: it schedules).
        ``record_routing``: keep every token's experts (a mixture-of-experts model on one pipeline stage)."""
        self.model = model.eval()
        pack_fused_weights(model)  # the fused projections then read their weights in place
        self.args = model.args
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.cfg = cfg
        self.link = link  # infer.group.StepLink when several processes, else None
        self.pipe = pipe  # infer.group.PipeLink when pipeline parallel, else None
        self.weight_version = weight_version
        weight = next(model.parameters())
        dtype = weight.dtype
        self.dtype = dtype
        # The model's device holds the cache and runs the step; sampling reads the logits on the host.
        self.device = weight.device
        kv_heads = self.args.n_kv_heads // tp_size
        # Every stage sizes its cache for the largest stage, so all ranks agree on the block count.
        stage_layers = -(-self.args.n_layers // (pipe.stages if pipe else 1))
        per_token = 2 * stage_layers * kv_heads * self.args.head_dim * dtype.itemsize
        num_blocks = max(1, int(cfg.kv_cache_mb * 2**20) // (per_token * cfg.block_size))
        self.caches = [KVCache((num_blocks + 1) * cfg.block_size, kv_heads, self.args.head_dim, dtype, self.device)
                       for _ in model.layers]
        self.step_ctx = StepContext()
        self.decode_mode = decode_mode(cfg.decode_attention, cfg.pad_rows, self.device)
        install_paged_attention(model, self.caches, self.step_ctx)
        self.pool = BlockPool(num_blocks + 1, cfg.block_size)
        # One block never given to a sequence: padding tokens write their keys and values there.
        self.scratch = self.pool.reserve() if cfg.pad_rows > 1 else None
        self.scheduler = Scheduler(self.pool, cfg.max_batch_tokens, cfg.max_seqs, cfg.prefix_caching)
        self.requests: dict[str, RequestState] = {}
        self.tokens_generated = 0
        self.handoff_tokens = {"exported": 0, "imported": 0}  # positions' keys and values handed off (infer/handoff.py)
        self.grammars = Grammars(tokenizer, eos_id, self.args.vocab_size)  # structured outputs' compiler
        self.speculator = build_speculator(cfg, self.scheduler, self.args.max_seq_len, draft)
        self.routes = None  # (cache slots, sparse layers, k): the experts that computed each slot
        self.routed: dict[str, torch.Tensor] = {}  # finished request id -> its experts (the caller takes them)
        if record_routing:
            moe = self.args.moe
            if moe is None or pipe is not None:
                raise UserError("recording expert routing needs a mixture-of-experts model on one pipeline stage")
            slots = (num_blocks + 1) * cfg.block_size
            self.routes = torch.full((slots, self.args.n_layers - moe.n_dense_layers, moe.top_k), -1,
                                     dtype=route_dtype(moe.n_experts), device=self.device)

    # -- requests ------------------------------------------------------------------------------

    def room(self, prompt_len: int) -> int:
        """The most tokens a request with this prompt may generate (the context and the cache allow)."""
        return min(self.args.max_seq_len, self.scheduler.capacity_tokens()) - prompt_len

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise RequestError or SamplingError if the engine cannot take this request (reads nothing
        that changes)."""
        params.validate()
        params.check_tokens(self.args.vocab_size)
        if params.structured is not None:
            self.grammars.compile(params.structured)
        if not prompt:
            raise RequestError("the prompt is empty", "prompt")
        if any(t < 0 or t >= self.args.vocab_size for t in prompt):
            raise RequestError(f"prompt token ids must be in [0, {self.args.vocab_size})", "prompt")
        limit, n = self.args.max_seq_len, len(prompt)
        if n >= limit and params.max_tokens:
            raise RequestError(f"the prompt ({n} tokens) leaves no room for output in the model's context of "
                               f"{limit} tokens", "prompt")
        if n + params.max_tokens > limit:
            raise RequestError(f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                               f"context of {limit} tokens (max_tokens {limit - n} at most)", "max_tokens")
        capacity = self.scheduler.capacity_tokens()
        if n + params.max_tokens > capacity:
            raise RequestError(f"the request needs {n + params.max_tokens} tokens of KV cache; the whole cache "
                               f"holds {capacity} (lower max_tokens, or raise engine.kv_cache_mb)", "max_tokens")

    def add(self, rid: str, prompt: list[int], params: SamplingParams, follows: str | None = None,
            emitted: list[int] = (), priority: int = 0, handoff: bool = False, kv: torch.Tensor | None = None) -> None:
        """Queue a request; all or nothing: on any error the engine is as it was. ``follows``: a request
        in flight with the same prompt (another choice of one HTTP request), whose cached prompt this one
        maps once it is computed. ``emitted``: tokens the request already produced on another replica
        (one resumed by the router): they are computed with the prompt, and the text shown and a structured
        output's state are advanced past them; the randomness of each token is its position's
        (``TokenDraws``), so it goes on drawing as it would have there. ``priority``: its latency class
        (lower runs first; infer/scheduler.py). ``handoff``: end it after its first token with reason
        ``handoff``, its keys and values in the output; ``kv``: those of its prompt (and ``emitted`` but the
        last) from the engine that handed it off, taken into the cache if they fit (else recomputed)
        (infer/handoff.py)."""
        self.check(prompt, params)
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in flight")
        emitted = list(emitted)
        if (emitted and len(emitted) >= params.max_tokens) or any(t < 0 or t >= self.args.vocab_size for t in emitted):
            raise RequestError(f"a resumed request has {len(emitted)} tokens already (max_tokens "
                               f"{params.max_tokens}), each in [0, {self.args.vocab_size})", "resume")
        lead = self.requests.get(follows) if follows is not None else None
        seq = Sequence(rid, list(prompt) + emitted, len(prompt), len(prompt) + params.max_tokens,
                       reuse_prefix=params.prompt_logprobs is None, follows=lead.seq if lead else None,
                       priority=priority, handoff=handoff)
        tail = TextTail(self.tokenizer, params.stop, params.min_tokens)
        if emitted:
            tail.push(emitted)  # the text shown so far, as it was shown
        grammar = self.grammars.start(params.structured, emitted) if params.structured is not None else None
        state = RequestState(seq, params, params.draws(), tail, grammar)
        self.scheduler.add(state.seq)  # last: a sequence in the scheduler always has its request state
        self.requests[rid] = state
        n = len(seq.tokens) - 1
        if kv is not None and n > 0 and fits(self.caches, kv, n) and self.scheduler.grow(seq, n):
            import_kv(self.caches, seq.blocks, kv, self.cfg.block_size)
            self.handoff_tokens["imported"] += n
            self.scheduler.commit(Piece(seq, 0, n))  # computed, and its full blocks published

    def abort(self, rid: str) -> Output | None:
        state = self.requests.pop(rid, None)
        if state is None:
            return None
        self.scheduler.abort(rid)
        return Output(rid, [], "", True, "abort", self.weight_version)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one step --------------------------------------------------------------------------------

    # Inference mode, not just no_grad: no version counters or view tracking, which measurably cuts the
    # per-operator cost of small (dispatch-bound) steps. Nothing a step creates is used by autograd.
    @torch.inference_mode()
    def step(self) -> list[Output]:
        pieces = self.scheduler.schedule()
        if not pieces:
            return []
        drafts: dict[str, Drafts] = {}
        if self.speculator is not None:  # decoding pieces widened by their drafts, for this step only
            pieces, drafts = self.speculator.draft(pieces, self.requests)
        batch, sampled, scored = self._batch(pieces, drafts)
        if self.link is not None:
            self.link.send_step(batch)
        logits = self.forward(batch)
        for piece in pieces:  # a drafted piece commits its real tokens; verification decides the drafts
            d = drafts.get(piece.seq.rid)
            self.scheduler.commit(Piece(piece.seq, piece.start, piece.n - len(d.fed)) if d else piece)
        logits = logits.float().to(HOST)
        at = len(sampled) + sum(len(d.fed) for d in drafts.values())
        for state, n in scored:  # prompt rows, after the sampled ones: scored before the first sample
            self._score(state, logits[at:at + n])
            at += n
        choices = self._sample(sampled, drafts, logits)
        outputs, at = [], 0
        for piece in sampled:
            state, d = self.requests[piece.seq.rid], drafts.get(piece.seq.rid)
            k = len(d.fed) if d else 0
            if d:  # k + 1 rows: verify the drafts, emit what is kept and one more token
                outputs.append(self.speculator.advance(state, logits[at:at + k + 1], d,
                                                       lambda c, s=state: self._advance(s, c)))
            else:
                outputs.append(self._advance(state, choices.get(piece.seq.rid)))
            at += k + 1
        return outputs

    def _sample(self, sampled: list[Piece], drafts: dict[str, Drafts], logits: torch.Tensor) -> dict[str, Choice]:
        """The next token of every sampled request without drafts, all rows at once (``sample_rows``)."""
        rows, items, at = [], [], 0
        for piece in sampled:
            state, d = self.requests[piece.seq.rid], drafts.get(piece.seq.rid)
            if not d and state.params.max_tokens > 0:
                grammar = state.grammar
                rows.append(at)
                items.append((state, grammar.allowed() if grammar else None))
            at += (len(d.fed) if d else 0) + 1
        if not rows:
            return {}
        got = sample_rows(logits[rows] if len(rows) < len(logits) else logits,
                          [(s.params, lambda s=s: s.draws.at(len(s.generated)), s.generated, allowed)
                           for s, allowed in items], self.eos_id)
        return {s.seq.rid: c for (s, _), c in zip(items, got)}

    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits (len(batch.rows), vocab) of the requested stream offsets (None on a rank without them)."""
        m = self.model
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        if m.tok_embeddings is not None:
            x = torch.tensor([batch.tokens], dtype=torch.long, device=self.device)  # (1, tokens)
        else:  # a later pipeline stage: the previous stage's activations (1, tokens, dim)
            x = self.pipe.recv_hidden(len(batch.tokens), self.args.dim, self.dtype)
        layout = batch.layout(self.cfg.block_size, self.pool.num_blocks * self.cfg.block_size, self.decode_mode,
                              self.device, self.args.sliding_window, self.dtype)
        routing = Routing(record=True) if self.routes is not None else None
        with self.step_ctx.use(layout):
            h = m.hidden(x, positions, routing)  # the model's own layers; attention reads and writes the paged cache
        if routing is not None:  # beside the keys and values: the experts that computed them
            self.routes[layout.slots] = routing.stacked().to(self.routes.dtype)  # (tokens, sparse layers, k)
        logits = None
        if m.output is not None:
            logits = m.head(h[:, batch.rows])[0]  # the norm and head over the sampled rows only
        else:
            self.pipe.send_hidden(h)
        if self.pipe is not None:
            logits = self.pipe.exchange_logits(logits, len(batch.rows), self.args.vocab_size, self.dtype)
        return logits

    def _batch(self, pieces: list[Piece], drafts: dict[str, Drafts] | None = None
               ) -> tuple[Batch, list[Piece], list[tuple[RequestState, int]]]:
        batch = Batch([], [], [], [])
        sampled, scored, starts = [], [], []
        for p in pieces:
            q_start = len(batch.tokens)
            starts.append(q_start)
            batch.tokens += p.seq.tokens[p.start:p.start + p.n]
            batch.positions += range(p.start, p.start + p.n)
            batch.spans.append((q_start, p.n, p.start + p.n, list(p.seq.blocks)))
            if p.sample:  # the last row; with k drafts, the k + 1 last rows
                d = drafts.get(p.seq.rid) if drafts else None
                k = len(d.fed) if d else 0
                batch.rows += range(q_start + p.n - 1 - k, q_start + p.n)
                sampled.append(p)
        for p, q_start in zip(pieces, starts):
            state = self.requests[p.seq.rid]
            if state.params.prompt_logprobs is not None:
                # Rows of positions whose next token is a prompt token, not yet scored (a preempted
                # sequence recomputes its prompt; its scores stay).
                first, end = max(p.start, len(state.prompt_choices)), min(p.start + p.n, p.seq.prompt_len - 1)
                if end > first:
                    batch.rows += range(q_start + first - p.start, q_start + end - p.start)
                    scored.append((state, end - first))
        self._pad(batch)
        return batch, sampled, scored

    def _score(self, state: RequestState, logits: torch.Tensor) -> None:
        """Log-probabilities of the next prompt tokens from their preceding rows' ``logits``."""
        done = len(state.prompt_choices)
        targets = state.seq.tokens[done + 1:done + 1 + len(logits)]
        state.prompt_choices += score_rows(logits, targets, state.params.prompt_logprobs)

    def _pad(self, batch: Batch) -> None:
        """Round the token count and the sampled rows up to a multiple of ``pad_rows``.

        Padding tokens form one extra span at positions 0.. in the scratch block (at most a block
        long each, so chained blocks hold them); their logits, like the padded rows, are never read.
        """
        k = self.cfg.pad_rows
        extra = -len(batch.tokens) % k
        if extra:
            bs = self.cfg.block_size
            blocks = [self.scratch] * -(-extra // bs)
            batch.spans.append((len(batch.tokens), extra, extra, blocks))
            batch.tokens += [0] * extra
            batch.positions += range(extra)
        batch.rows += batch.rows[-1:] * (-len(batch.rows) % k)

    def routing_of(self, seq: Sequence) -> torch.Tensor:
        """The experts that computed each of ``seq``'s positions fed so far (all its tokens but the last):
        (positions, sparse layers, k) on the host, read through its block table."""
        return self.routes[slots_of(seq.blocks, len(seq.tokens) - 1, self.cfg.block_size, self.device)].to(HOST)

    def _advance(self, state: RequestState, choice: Choice | None) -> Output:
        """Append ``choice``, the request's next token (sampled by ``_sample``, or verified by speculative
        decoding; None when the request generates nothing), and decide whether the request is finished."""
        seq = state.seq
        prompt = state.prompt_choices if state.params.prompt_logprobs is not None and seq.prompt_len == len(
            seq.tokens) else None  # the first output carries the prompt's scores
        if state.params.max_tokens == 0:  # the prompt scored, nothing to generate
            self.scheduler.finish(seq)
            del self.requests[seq.rid]
            return Output(seq.rid, [], "", True, "length", self.weight_version, prompt)
        grammar = state.grammar
        seq.tokens.append(choice.token)
        self.tokens_generated += 1
        if grammar is not None:
            grammar.advance(choice.token)
        shown = state.generated
        if stops_on(choice.token, state.params, self.eos_id):
            reason = "stop"
            shown = shown if choice.token == self.eos_id else shown[:-1]  # a stop token's text is not shown
        elif grammar is not None and grammar.done:  # the structured output is complete
            reason = "stop"
        elif len(state.generated) >= state.params.max_tokens or len(seq.tokens) >= self.args.max_seq_len:
            reason = "length"
        else:
            reason = None
        text, hit = state.tail.push(shown, final=reason is not None)
        if hit:
            reason = "stop"
        kv = None
        if reason is None and seq.handoff:  # its keys and values go to the engine that decodes it
            reason, kv = "handoff", export_kv(self.caches, seq.blocks, seq.computed, self.cfg.block_size)
            self.handoff_tokens["exported"] += seq.computed
        out = Output(seq.rid, [choice], text, reason is not None, reason, self.weight_version, prompt, kv)
        if reason is not None:
            if self.routes is not None:
                self.routed[seq.rid] = self.routing_of(seq)
            self.scheduler.finish(seq)
            del self.requests[seq.rid]
        return out

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(self, read: Callable[[], dict[str, torch.Tensor]], version: int) -> None:
        """Replace the weights with ``read()``'s (a full state dict), between two steps.

        Over several processes every rank calls this for the same update (rank 0 announces it first,
        since reading a run checkpoint is itself a collective) and the ranks agree before any copies:
        if any rank could not read or check the weights, every rank keeps its old ones.
        """
        from stalwart.infer.load import check_full_state

        state, error = None, None
        try:
            state = read()
            check_full_state(self.model, state)
        except Exception as e:  # noqa: BLE001 - reported below, after the ranks agree
            error = e
        if self.link is not None and not self.link.agree(error is None) and error is None:
            error = UserError("another process of this replica could not read these weights")
        if error is not None:
            raise error
        self.load_full_state(state, version)

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy a full (unsharded) state dict into this rank's weights, sharding where tensor parallel.

        Sequences in flight keep their cache and go on with the new weights (each response lists the
        versions that produced it); cached prefixes computed with the old weights are forgotten.
        """
        from stalwart.infer.load import copy_full_state

        copy_full_state(self.model, state)
        self.weight_version = version
        self._forget_prefixes()

    def recompute_all(self) -> None:
        """Forget every cached key and value: running sequences are recomputed when readmitted (a rank of
        this replica was started again with an empty cache), and no cached prefix is reused."""
        self.scheduler.preempt_all()
        self._forget_prefixes()

    def _forget_prefixes(self) -> None:
        self.pool.by_digest.clear()
        self.pool.digest_of.clear()

    def stats(self) -> dict[str, float]:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_blocks_used": self.pool.used - self.pool.reserved,
                "kv_blocks_total": self.pool.num_blocks - self.pool.reserved,
                "preemptions": self.scheduler.preempted_total, "prefix_cached_tokens": self.scheduler.cached_tokens_total,
                "tokens_generated": self.tokens_generated, "weight_version": self.weight_version,
                **{f"kv_{k}_tokens": v for k, v in self.handoff_tokens.items()},
                **(self.speculator.stats() if self.speculator is not None else {})}
