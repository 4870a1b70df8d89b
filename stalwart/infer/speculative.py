"""Speculative decoding: guess a sequence's next tokens, let the model check the guesses in the step's
one forward pass, keep the ones it agrees with. The guesses come from prompt lookup (``ngram``) or from
a smaller draft model with the same vocabulary (``DraftModelProposer``: stateless); both are a
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
greedy decoding without speculation picks. Sampling (temperature, top-k, top-p): standard speculative
sampling. The guess ``d`` for a position was drawn from a draft distribution ``q`` (the draft model's
under the request's temperature, top-k and top-p; a point mass for prompt lookup); it is kept with
probability min(1, p(d) / q(d)) under the request's filtered distribution ``p``, and a rejection draws
from max(0, p - q) normalised, so each output token is distributed exactly as without speculation. A
sampled request also gets a guess for the position after its fed drafts, checked against the last row
alone, so every token it emits is such a verified draw, with that position's own draws
(``generate.TokenDraws``): token i is a function of its seed, i, its row and its guess, and guesses
depend only on the tokens before them. A seeded request therefore emits the same tokens however its
steps fall (on another replica after a resume too), though not the tokens it draws without
speculation. Kept drafts' keys and values are already in the cache; the rejected ones' slots are
overwritten later, and they were never published for prefix reuse (the scheduler commits only the
sequence's real tokens).

A structured output speculates too: each row is masked by its grammar's state after the drafts before
it, so a draft the grammar refuses is never kept. Requests whose next token depends on more than the
logits row and grammar (logit_bias, penalties, min_tokens) or that report log-probabilities decode one
token per step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from stalwart.errors import UserError
from stalwart.generate import TokenDraws, filter_logits, next_token
from stalwart.infer.sampling import Choice, SamplingParams
from stalwart.infer.scheduler import Piece, Scheduler
from stalwart.infer.structured import GrammarState
from stalwart.runtime.device import HOST


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


@dataclass
class Drafts:
    """One sequence's guesses for a step. ``fed`` join the forward pass (the piece grows by them: a row
    each, plus the row after the last). ``check``, a sampled request's guess for the token after them, is
    checked against that last row alone, so every token a sampled request emits is one verified draw
    whatever the step it falls in (see ``verify``). ``q``: the draft distribution each of ``fed`` (then
    ``check``) was drawn from, (vocab,) fp32 on the host; None: point masses (prompt lookup, greedy)."""

    fed: list[int]
    check: int | None = None
    q: list[torch.Tensor] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.fed + ([self.check] if self.check is not None else [])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected draft's token is drawn from: max(0, p - q) (normalised by the draw)."""
    return (p - q).clamp_(min=0.0)


def accept_or_resample(probs: torch.Tensor, d: int, q: torch.Tensor | None, gen: torch.Generator) -> int:
    """Standard speculative sampling of one token: keep the draft ``d`` (drawn from ``q``; None: a point
    mass on ``d``) with probability min(1, p(d) / q(d)) under the target's ``probs`` p, else draw from
    ``residual(p, q)``. The token is distributed as p whatever q is. Draws: one uniform, then (on a
    rejection) one multinomial, both from ``gen``."""
    qd = 1.0 if q is None else float(q[d])
    pd = float(probs[d])
    if float(torch.rand((), generator=gen)) * qd < pd:  # u < p(d) / q(d), without dividing by zero
        return d
    if q is None:
        q = torch.zeros_like(probs)
        q[d] = 1.0
    rest = residual(probs, q)
    if not float(rest.sum()) > 0.0:  # p <= q everywhere only when p == q (up to rounding): then p itself
        rest = probs
    return int(torch.multinomial(rest, 1, generator=gen))


def verify(rows: torch.Tensor, drafts: Drafts, params: SamplingParams, draws: TokenDraws | None, index: int,
           grammar: GrammarState | None = None) -> list[int]:
    """The tokens a step emits for one sequence: the drafts kept, then one more token.

    ``rows`` (len(drafts.fed) + 1, vocab) fp32 on the host: row i is the model's logits for the token
    after the context plus ``drafts.fed[:i]``; ``index``: the output position of row 0's token. Greedy: a
    draft is kept while it is its row's most likely token; the first that is not, or the last row, gives
    its most likely token. Sampling: row i's token is ``accept_or_resample`` of that position's guess
    (``drafts.tokens[i]``), with the position's draws (``draws.at(index + i)``); a position without a
    guess draws from its row as without speculation. So token i depends on its position, its row and its
    guess alone, never on where the step began: with guesses that depend only on the tokens before them
    (``DraftModelProposer``, ``ngram_proposer`` for sampled requests), a seeded request emits the same
    tokens however its steps fall, resumed on another replica included.

    With a structured output's ``grammar``, each row is masked by the grammar's state after the drafts
    before it (a draft the grammar refuses is never kept); the state is left as it was (the engine
    advances it by every token emitted)."""
    out: list[int] = []
    guesses = drafts.tokens
    advanced = 0
    try:
        for i, row in enumerate(rows):
            allowed = grammar.allowed() if grammar is not None else None
            d = guesses[i] if i < len(guesses) else None
            if params.temperature <= 0.0:
                token = next_token(row, 0.0, 0, 1.0, None, allowed)
            elif d is None:
                token = next_token(row, params.temperature, params.top_k, params.top_p, draws.at(index + i), allowed)
            else:
                if allowed is not None:
                    row = row.masked_fill(~allowed, float("-inf"))
                probs = torch.softmax(filter_logits(row, params.temperature, params.top_k, params.top_p), dim=-1)
                q = drafts.q[i] if drafts.q is not None else None
                token = accept_or_resample(probs, d, q, draws.at(index + i))
            out.append(token)
            if token != d or i == len(rows) - 1:
                return out
            if grammar is not None:
                grammar.advance(d)
                advanced += 1
                if grammar.done:  # the output is complete with this draft: nothing follows it
                    return out
        return out
    finally:
        if grammar is not None:
            grammar.rollback(advanced)


def may_speculate(params: SamplingParams) -> bool:
    """Whether a request's next token depends on its logits row (and grammar) alone, so drafts can be
    checked: not with logit adjustments that follow the output, nor with log-probabilities to report."""
    return not (params.adjusts or params.logprobs is not None or params.prompt_logprobs is not None)


@dataclass
class DraftSampling:
    """A sampled request's drafting: its parameters, its draws, and the output position of its first
    draft (draft i of the position uses ``draws.at(start + i, 1)``)."""

    params: SamplingParams
    draws: TokenDraws
    start: int


Proposer = Callable[[list[list[int]], list[int], list[DraftSampling | None]], list[Drafts]]
"""Guesses for several sequences at once: (their tokens so far, the most guesses each may take, how each
samples: None for greedy) -> the guesses of each (``Drafts.fed`` only: at most that many, possibly none,
and for a sampled sequence the draft distributions in ``q`` where they are not point masses). The
speculator decides which of them join the forward pass and which is checked against its last row."""


def ngram_proposer(max_n: int) -> Proposer:
    """Prompt lookup (``propose_ngram``) for each sequence. Greedy: the tokens that followed the match.
    Sampled: each guess looked up afresh for the context plus the guesses before it, so a position's
    guess depends only on the tokens before it (``verify``); the guesses stop at the first position
    without a match."""

    def propose(contexts: list[list[int]], rooms: list[int], samplings: list[DraftSampling | None]) -> list[Drafts]:
        out = []
        for c, r, sampling in zip(contexts, rooms, samplings):
            if sampling is None:
                out.append(Drafts(propose_ngram(c, max_n, r)))
                continue
            guesses: list[int] = []
            while len(guesses) < r:
                one = propose_ngram(c + guesses, max_n, 1)
                if not one:
                    break
                guesses += one
            out.append(Drafts(guesses))
        return out

    return propose


class DraftModelProposer:
    """Drafts from a smaller model with the target's vocabulary.

    Stateless: each step the draft reads the latest ``window`` tokens of every sequence afresh (no cache
    to keep in step with kept and rejected drafts, preemption or weight swaps) and extends them one
    forward pass per drafted token, the window sliding over the drafts (each pass reads the latest
    ``window`` tokens of the context plus the drafts before it, so a draft depends only on the tokens
    before it); sequences whose window has the same length share each pass. The window starts at
    position 0 whatever its place in the sequence: rotary attention depends only on the distance between
    tokens, and a draft needs only to be a good guess, never exact. Greedy sequences take the draft's
    most likely token; sampled ones draw it from the draft's distribution under their own temperature,
    top-k and top-p (q, returned for ``verify``), with their position's draft draws.
    """

    def __init__(self, model: torch.nn.Module, window: int) -> None:
        self.model = model.eval()
        self.window = window
        self.max_seq_len = model.args.max_seq_len
        self.device = next(model.parameters()).device

    def __call__(self, contexts: list[list[int]], rooms: list[int],
                 samplings: list[DraftSampling | None] | None = None) -> list[Drafts]:
        samplings = samplings or [None] * len(contexts)
        width = min(self.window, self.max_seq_len)
        groups: dict[int, list[int]] = {}  # window length -> the sequences with it
        for i, c in enumerate(contexts):
            if rooms[i] > 0:
                groups.setdefault(min(width, len(c)), []).append(i)
        out = [Drafts([]) for _ in contexts]
        for n, members in groups.items():
            x = torch.tensor([contexts[i][-n:] for i in members], dtype=torch.long, device=self.device)  # (batch, n)
            drafted: list[list[int]] = [[] for _ in members]
            qs: list[list[torch.Tensor]] = [[] for _ in members]
            for step in range(max(rooms[i] for i in members)):
                last = self.model.head(self.model.hidden(x)[:, -1])  # (batch, vocab)
                picks = last.argmax(-1)
                sampled = [m for m, i in enumerate(members) if samplings[i] is not None and step < rooms[i]]
                if sampled:
                    rows = last.float().to(HOST)
                    picks = picks.to(HOST)
                    for m in sampled:
                        s = samplings[members[m]]
                        q = torch.softmax(filter_logits(rows[m], s.params.temperature, s.params.top_k,
                                                        s.params.top_p), dim=-1)
                        picks[m] = torch.multinomial(q, 1, generator=s.draws.at(s.start + step, 1))[0]
                        qs[m].append(q)
                for m, t in enumerate(picks.tolist()):
                    drafted[m].append(t)
                x = torch.cat([x, picks.to(x.device)[:, None]], dim=1)[:, -width:]
            for m, i in enumerate(members):
                out[i] = Drafts(drafted[m][:rooms[i]], q=qs[m] if samplings[i] is not None else None)
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

    def draft(self, pieces: list[Piece], requests: dict) -> tuple[list[Piece], dict[str, Drafts]]:
        """The step's pieces, sequences widened by the drafts they feed (appended to their sequences),
        within the token budget and the cache; and the drafts by request id.

        A decoding piece may feed up to ``tokens`` drafts. A sampled request also gets a guess for the
        token after its fed drafts, checked against its last row (``Drafts.check``), at every piece that
        samples (prompt-ending ones included), so each of its tokens is drawn the same way wherever a
        step begins (``verify``)."""
        wants: dict[int, int] = {}  # piece index -> the guesses to ask for
        samplings: dict[int, DraftSampling | None] = {}
        for i, p in enumerate(pieces):
            seq, state = p.seq, requests.get(p.seq.rid)
            if not p.sample or state is None or not may_speculate(state.params):
                continue
            room = min(self.tokens, seq.max_total - len(seq.tokens) - 1, self.max_seq_len - len(seq.tokens) - 1)
            room = max(room, 0) if p.n == 1 else 0
            sampled = state.params.temperature > 0.0
            if room > 0 or sampled:
                wants[i] = room + sampled
                samplings[i] = DraftSampling(state.params, state.draws, len(seq.tokens) - seq.prompt_len) \
                    if sampled else None
        if not wants:
            return pieces, {}
        proposals = dict(zip(wants, self.propose([pieces[i].seq.tokens for i in wants], list(wants.values()),
                                                 [samplings[i] for i in wants])))
        budget = self.scheduler.max_batch_tokens - sum(p.n for p in pieces)
        out, drafts = [], {}
        for i, p in enumerate(pieces):
            seq, proposal = p.seq, proposals.get(i)
            if proposal is None or not proposal.fed:
                out.append(p)
                continue
            sampled = samplings[i] is not None
            fed = min(len(proposal.fed), wants[i] - sampled, max(budget, 0))
            if fed and not self.scheduler.grow(seq, p.start + p.n + fed):
                fed = 0
            if fed == 0 and not sampled:
                out.append(p)
                continue
            guesses = proposal.fed
            d = Drafts(guesses[:fed], guesses[fed] if sampled and fed < len(guesses) else None,
                       proposal.q[:fed + 1] if proposal.q is not None else None)
            seq.tokens += d.fed
            drafts[seq.rid] = d
            out.append(Piece(seq, p.start, p.n + fed))
            budget -= fed
        return out, drafts

    def advance(self, state, rows: torch.Tensor, drafts: Drafts, advance: Callable[[Choice], object]):
        """Verify one sequence's drafts against its ``rows`` and emit the tokens through ``advance`` (the
        engine's one-token step: stop strings, end of text, limits), stopping where the request finishes.
        Returns the step's one Output, holding every token emitted."""
        seq = state.seq
        real = len(seq.tokens) - len(drafts.fed)
        tokens = verify(rows, drafts, state.params, state.draws, real - seq.prompt_len, state.grammar)
        guesses = drafts.tokens
        kept = next((i for i, (t, d) in enumerate(zip(tokens, guesses)) if t != d), min(len(tokens), len(guesses)))
        self.proposed += len(guesses)
        self.accepted += kept
        del seq.tokens[real:]  # the drafts leave; the kept ones come back one by one below
        outs = []
        for token in tokens:
            outs.append(advance(Choice(token)))
            if outs[-1].finished:
                break
        if not outs[-1].finished:
            seq.computed = real + min(kept, len(drafts.fed))  # kept fed drafts are cached; what follows is not
        return replace(outs[-1], choices=[c for o in outs for c in o.choices], text="".join(o.text for o in outs))

    def stats(self) -> dict[str, float]:
        return {"speculative_proposed": self.proposed, "speculative_accepted": self.accepted}
