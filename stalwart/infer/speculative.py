"""Speculative decoding: guess a sequence's next tokens, let the model check the guesses in the step's
one forward pass, keep the ones it agrees with. The guesses come from prompt lookup (``ngram``) or from
a smaller draft model with the same vocabulary (``DraftModelProposer``: greedy, stateless); both are a
``Proposer`` and everything after the proposal is shared.

Each step, for every sequence that is decoding (one token to compute) and may speculate, ``draft``
looks for the latest earlier occurrence of the context's last n-gram (n = ``speculative_ngram`` down to
1) in its prompt and output and proposes the up to ``speculative_tokens`` tokens that followed it
(code, quoted text and edits repeat their input, so these guesses are often right). The drafts join the
sequence for this step only: its piece grows from 1 token to 1 + k, the forward pass computes their
keys and values with everything else in the batch, and the head returns the k + 1 rows of logits (the
row before each draft, and the one after the last).

``verify`` then reads the rows in order. Greedy: a draft is kept while it is the row's most likely
token, and the first row that disagrees gives its own most likely token; every token is the one
greedy decoding without speculation picks. Sampling (temperature, top-k, top-p): a draft ``d`` is a
proposal with all its mass on ``d``, so standard speculative sampling keeps it with probability
``p(d)`` (one uniform draw from the request's generator) under the request's filtered distribution
``p``, and a rejection draws from ``p`` with ``d`` removed; after k kept drafts the last row is sampled
as usual. Each output token is thereby distributed exactly as without speculation (not the same tokens
for a seed: the draws differ). Kept drafts' keys and values are already in the cache; the rejected
ones' slots are overwritten later, and they were never published for prefix reuse (the scheduler
commits only the sequence's real tokens).

A structured output speculates too: each row is masked by its grammar's state after the drafts before
it, so a draft the grammar refuses is never kept. Requests whose next token depends on more than the
logits row and grammar (logit_bias, penalties, min_tokens) or that report log-probabilities decode one
token per step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from stalwart.errors import UserError
from stalwart.generate import filter_logits, next_token
from stalwart.infer.sampling import Choice, SamplingParams
from stalwart.infer.scheduler import Piece, Scheduler
from stalwart.infer.structured import GrammarState


def propose_ngram(tokens: list[int], max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens of ``tokens``,
    for the longest n <= ``max_n`` that occurs earlier; [] when none does."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), 0, -1):
        pattern, last = tokens[size - n:], tokens[-1]
        for i in range(size - n - 1, -1, -1):  # occurrences ending before the last token, latest first
            if tokens[i + n - 1] == last and tokens[i:i + n] == pattern:
                return tokens[i + n:i + n + k]
    return []


def verify(rows: torch.Tensor, drafts: list[int], params: SamplingParams, gen: torch.Generator,
           grammar: GrammarState | None = None) -> list[int]:
    """The tokens a step emits for one sequence: the drafts kept, then one token drawn by the model.

    ``rows`` (len(drafts) + 1, vocab) fp32 on the host: row i is the model's logits for the token after
    the context plus ``drafts[:i]``. With a structured output's ``grammar``, each row is masked by the
    grammar's state after the drafts before it (a draft the grammar refuses is never kept); the state
    is left as it was (the engine advances it by every token emitted)."""
    out: list[int] = []
    advanced = 0
    try:
        for row, d in zip(rows, drafts):
            allowed = grammar.allowed() if grammar is not None else None
            if params.temperature <= 0.0:
                token = next_token(row, 0.0, 0, 1.0, gen, allowed)
                out.append(token)
                if token != d:
                    return out
            else:
                if allowed is not None:
                    row = row.masked_fill(~allowed, float("-inf"))
                probs = torch.softmax(filter_logits(row, params.temperature, params.top_k, params.top_p), dim=-1)
                if float(torch.rand((), generator=gen)) >= float(probs[d]):
                    probs[d] = 0.0  # the residual max(0, p - q) for a proposal q with all its mass on d
                    out.append(int(torch.multinomial(probs, 1, generator=gen)))
                    return out
                out.append(d)
            if grammar is not None:
                grammar.advance(d)
                advanced += 1
                if grammar.done:  # the output is complete with this draft: nothing follows it
                    return out
        allowed = grammar.allowed() if grammar is not None else None
        out.append(next_token(rows[len(out)], params.temperature, params.top_k, params.top_p, gen, allowed))
        return out
    finally:
        if grammar is not None:
            grammar.rollback(advanced)


def may_speculate(params: SamplingParams) -> bool:
    """Whether a request's next token depends on its logits row (and grammar) alone, so drafts can be
    checked: not with logit adjustments that follow the output, nor with log-probabilities to report."""
    return not (params.adjusts or params.logprobs is not None or params.prompt_logprobs is not None)


Proposer = Callable[[list[list[int]], list[int]], list[list[int]]]
"""Drafts for several sequences at once: (their tokens so far, the most drafts each may take) -> the
drafts of each (at most that many, possibly none)."""


def ngram_proposer(max_n: int) -> Proposer:
    """Prompt lookup (``propose_ngram``) for each sequence."""
    return lambda contexts, rooms: [propose_ngram(c, max_n, r) for c, r in zip(contexts, rooms)]


class DraftModelProposer:
    """Greedy drafts from a smaller model with the target's vocabulary.

    Stateless: each step the draft reads the latest ``window`` tokens of every sequence afresh (no cache
    to keep in step with kept and rejected drafts, preemption or weight swaps) and extends them greedily,
    one forward pass per drafted token; sequences whose window has the same length share each pass. The
    window starts at position 0 whatever its place in the sequence: rotary attention depends only on the
    distance between tokens, and a draft needs only to be a good guess, never exact. Greedy drafts are
    point masses, so ``verify`` keeps greedy output and the sampled distribution unchanged.
    """

    def __init__(self, model: torch.nn.Module, window: int) -> None:
        self.model = model.eval()
        self.window = window
        self.max_seq_len = model.args.max_seq_len
        self.device = next(model.parameters()).device

    def __call__(self, contexts: list[list[int]], rooms: list[int]) -> list[list[int]]:
        k = max(rooms, default=0)
        width = min(self.window, self.max_seq_len - k)  # the window and its drafts fit the draft's context
        if k <= 0 or width <= 0:
            return [[] for _ in contexts]
        groups: dict[int, list[int]] = {}  # window length -> the sequences with it
        for i, c in enumerate(contexts):
            groups.setdefault(min(width, len(c)), []).append(i)
        out: list[list[int]] = [[] for _ in contexts]
        for n, members in groups.items():
            x = torch.tensor([contexts[i][-n:] for i in members], dtype=torch.long, device=self.device)  # (batch, n)
            for _ in range(max(rooms[i] for i in members)):
                last = self.model.head(self.model.hidden(x)[:, -1])  # (batch, vocab)
                x = torch.cat([x, last.argmax(-1, keepdim=True)], dim=1)
            drafted = x[:, n:].tolist()
            for i, d in zip(members, drafted):
                out[i] = d[:rooms[i]]
        return out


def check_draft_vocabulary(target_vocab: int, target_tokenizer, draft_vocab: int, draft_tokenizer,
                           where: str) -> None:
    """Raise UserError unless the draft model (named ``where``) has the target's vocabulary: the same
    vocabulary size and, where tokenizers are given, the same token -> id map."""
    if draft_vocab != target_vocab:
        raise UserError(f"{where}: the draft model's vocabulary has {draft_vocab} entries, the served model's "
                        f"{target_vocab}; a draft model must share the served model's tokenizer")
    if target_tokenizer is not None and draft_tokenizer is not None:
        ours, theirs = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if ours != theirs:
            differ = sorted(set(ours.items()) ^ set(theirs.items()))[:1]
            raise UserError(f"{where}: the draft model's tokenizer differs from the served model's (e.g. "
                            f"{differ[0][0]!r}); a draft model must share the served model's tokenizer")


def load_draft_model(where: str, target_vocab: int, target_tokenizer, dtype: torch.dtype,
                     device: torch.device) -> torch.nn.Module:
    """The draft model named by ``where`` (engine.draft_model), in ``dtype`` on ``device``, after checking
    that it shares the served model's vocabulary (UserError, before anything is served, if not)."""
    from stalwart.infer.load import build_model, read_source, source_from

    loaded = read_source(source_from(where))
    check_draft_vocabulary(target_vocab, target_tokenizer, loaded.args.vocab_size, loaded.tokenizer,
                           f"engine.draft_model {where}")
    return build_model(loaded, dtype, device)


def build_speculator(cfg, scheduler: Scheduler, max_seq_len: int,
                     draft: torch.nn.Module | None = None) -> Speculator | None:
    """The engine's speculator for ``cfg`` (an EngineConfig): None when off; 'draft' needs ``draft``,
    the loaded draft model."""
    if cfg.speculative == "off":
        return None
    if cfg.speculative == "ngram":
        return Speculator(scheduler, cfg.speculative_tokens, max_seq_len, ngram_proposer(cfg.speculative_ngram))
    if draft is None:
        raise UserError("engine.speculative = draft needs a draft model (engine.draft_model)")
    return Speculator(scheduler, cfg.speculative_tokens, max_seq_len, DraftModelProposer(draft, cfg.draft_window))


class Speculator:
    """Drafts for one engine's decoding sequences (from ``propose``), and the counts behind the
    acceptance rate."""

    def __init__(self, scheduler: Scheduler, tokens: int, max_seq_len: int, propose: Proposer) -> None:
        self.scheduler = scheduler
        self.tokens = tokens
        self.max_seq_len = max_seq_len
        self.propose = propose
        self.proposed = 0  # drafts checked by the model
        self.accepted = 0  # drafts kept

    def draft(self, pieces: list[Piece], requests: dict) -> tuple[list[Piece], dict[str, list[int]]]:
        """The step's pieces, decoding ones widened by their drafts (appended to their sequences), within
        the token budget and the cache; and the drafts by request id."""
        rooms: dict[int, int] = {}  # piece index -> the most drafts it may take (the budget aside)
        for i, p in enumerate(pieces):
            seq, state = p.seq, requests.get(p.seq.rid)
            room = min(self.tokens, seq.max_total - len(seq.tokens) - 1, self.max_seq_len - len(seq.tokens) - 1)
            if room > 0 and p.n == 1 and p.sample and state is not None and may_speculate(state.params):
                rooms[i] = room
        if not rooms:
            return pieces, {}
        proposals = dict(zip(rooms, self.propose([pieces[i].seq.tokens for i in rooms], list(rooms.values()))))
        budget = self.scheduler.max_batch_tokens - sum(p.n for p in pieces)
        out, drafts = [], {}
        for i, p in enumerate(pieces):
            seq = p.seq
            proposal = proposals.get(i, [])[:max(budget, 0)]
            if not proposal or not self.scheduler.grow(seq, p.start + 1 + len(proposal)):
                out.append(p)
                continue
            seq.tokens += proposal
            drafts[seq.rid] = proposal
            out.append(Piece(seq, p.start, 1 + len(proposal)))
            budget -= len(proposal)
        return out, drafts

    def advance(self, state, rows: torch.Tensor, drafts: list[int], advance: Callable[[Choice], object]):
        """Verify one sequence's drafts against its ``rows`` and emit the tokens through ``advance`` (the
        engine's one-token step: stop strings, end of text, limits), stopping where the request finishes.
        Returns the step's one Output, holding every token emitted."""
        tokens = verify(rows, drafts, state.params, state.gen, state.grammar)
        kept = next((i for i, (t, d) in enumerate(zip(tokens, drafts)) if t != d), min(len(tokens), len(drafts)))
        self.proposed += len(drafts)
        self.accepted += kept
        seq = state.seq
        real = len(seq.tokens) - len(drafts)
        del seq.tokens[real:]  # the drafts leave; the kept ones come back one by one below
        outs = []
        for token in tokens:
            outs.append(advance(Choice(token)))
            if outs[-1].finished:
                break
        if not outs[-1].finished:
            seq.computed = real + kept  # kept drafts are cached; the token after them is not yet
        return replace(outs[-1], choices=[c for o in outs for c in o.choices], text="".join(o.text for o in outs))

    def stats(self) -> dict[str, float]:
        return {"speculative_proposed": self.proposed, "speculative_accepted": self.accepted}
