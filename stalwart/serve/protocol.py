"""OpenAI's request and response shapes for completions and chat completions (the fields we honour).

Requests are pydantic models (a malformed body is a 400 naming the field); ranges are checked once,
by ``SamplingParams.validate``. Chat messages are rendered by ``serve/chat.py`` (the model's own
template when its directory ships one). A request asking for several choices (``n``, ``best_of``)
becomes one engine request per choice ("draw"): choice j of a prompt samples from its own generator,
seeded with ``sampling.choice_seed(seed, j)``, and the draws after the first wait for the first to
compute the shared prompt, then map its cached blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from stalwart.infer.sampling import Choice, SamplingError, SamplingParams, choice_seed
from stalwart.serve.chat import ChatFormat, message_text
from stalwart.serve.formats import ResponseFormat, StructuredOutputs, constraint_of

# Strict: a value of the wrong JSON type is refused, not coerced ("5" is no max_tokens, true no 1).
STRICT = ConfigDict(extra="ignore", strict=True)
MAX_CHOICES = 16  # n and best_of at most
PRIORITY_RANGE = (-100, 100)  # a request's latency class (lower runs first, as vLLM's priority)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False  # a last chunk with the whole request's usage (and no choices)


class RetrievalSpec(BaseModel):
    """A request's ``retrieval`` extension (serve/rag.py): search ``tenant``'s chunks of ``index`` (a name the
    server was started with) for the prompt, and answer with the ``k`` best as context."""

    model_config = ConfigDict(extra="forbid", strict=True)

    index: str
    tenant: str
    k: int = 4
    mode: Literal["hybrid", "vector", "keyword"] = "hybrid"
    filters: dict | None = None  # metadata key -> value or {"in": [values]} (retrieval/query.py)


class SamplingRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None  # draws per prompt, of which the n with the highest mean log-probability return
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias in [-100, 100]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # a structured output (serve/formats.py): OpenAI's response_format, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # the latency class (infer/scheduler.py): lower is admitted, scheduled and kept first; vLLM's field
    priority: int = 0
    retrieval: RetrievalSpec | None = None  # retrieval-augmented generation (serve/rag.py), an extension

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def param_name(self, engine_name: str | None) -> str | None:
        """The request field behind an engine or sampling parameter (they differ in chat)."""
        return engine_name

    @property
    def draws(self) -> int:
        """Sequences generated per prompt."""
        return self.best_of if self.best_of is not None else self.n

    def draw_params(self, params: SamplingParams) -> list[SamplingParams]:
        """The parameters of each draw of one prompt: its own seed; only the first scores the prompt (the
        others reuse its scores); with ``best_of > n`` every draw reports its log-probabilities (to rank)."""
        out = []
        for j in range(self.draws):
            p = dataclasses.replace(params, seed=choice_seed(params.seed, j),
                                    prompt_logprobs=params.prompt_logprobs if j == 0 else None)
            if self.draws > self.n and p.logprobs is None:
                p.logprobs = 0
            out.append(p)
        return out

    def _logit_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise SamplingError(f"logit_bias keys must be token ids (got {key!r})", "logit_bias") from None
        return bias

    def _params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        lo, hi = PRIORITY_RANGE
        if not lo <= self.priority <= hi:
            raise SamplingError(f"priority must be in [{lo}, {hi}] (got {self.priority}; lower runs first)", "priority")
        if not 1 <= self.n <= MAX_CHOICES:
            raise SamplingError(f"n must be in [1, {MAX_CHOICES}] (got {self.n})", "n")
        if self.best_of is not None:
            if not self.n <= self.best_of <= MAX_CHOICES:
                raise SamplingError(f"best_of must be in [n = {self.n}, {MAX_CHOICES}] (got {self.best_of})",
                                    "best_of")
            if self.stream and self.best_of > self.n:
                raise SamplingError("best_of greater than n cannot be streamed", "best_of")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, stop=stop, logprobs=logprobs, seed=self.seed,
                              ignore_eos=self.ignore_eos, stop_token_ids=list(self.stop_token_ids or []),
                              min_tokens=self.min_tokens, logit_bias=self._logit_bias(),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              structured=constraint_of(self.response_format, self.structured_outputs))


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def sampling(self) -> SamplingParams:
        """The sampling parameters; max_tokens defaults to 16, as in OpenAI's completions API, and may be
        0 with ``echo`` (the prompt back, scored when ``logprobs`` is set: nothing generated)."""
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if max_tokens < 1 and not (self.echo and max_tokens == 0):
            raise SamplingError(f"max_tokens must be >= 1 (got {max_tokens}; 0 only with echo)", "max_tokens")
        params = self._params(max_tokens, self.logprobs)
        if self.echo and (self.logprobs is not None or max_tokens == 0):
            params.prompt_logprobs = self.logprobs or 0
        return params

    def token_prompts(self, tokenizer) -> list[list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [tokenizer.encode(p, add_special_tokens=False).ids]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        if not p:
            return [[]]
        return [tokenizer.encode(x, add_special_tokens=False).ids if isinstance(x, str) else list(x) for x in p]

    def prompt_texts(self, prompts: list[list[int]], tokenizer) -> list[str]:
        """Each prompt as text, for ``echo``: as sent when it was a string, else its tokens decoded."""
        p = self.prompt
        if isinstance(p, str):
            sent = [p]
        elif not p or isinstance(p[0], int):  # one prompt of token ids
            sent = [None]
        else:
            sent = [x if isinstance(x, str) else None for x in p]
        return [t if t is not None else tokenizer.decode(ids, skip_special_tokens=False)
                for t, ids in zip(sent, prompts)]


class ContentPart(BaseModel):
    """One part of a message's content in OpenAI's list form; only text parts are taken."""

    model_config = STRICT

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None  # a string, text parts, or none (an assistant's tool call)


class ChatRequest(SamplingRequest):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def _max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def param_name(self, engine_name: str | None) -> str | None:
        names = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": self._max_tokens_field}
        return names.get(engine_name, engine_name)

    def token_prompt(self, tokenizer, chat: ChatFormat) -> list[int]:
        """The conversation rendered (``chat``: the model's template) and tokenized, as the engine computes it."""
        return tokenizer.encode(chat_prompt(self.messages, chat), add_special_tokens=False).ids

    def sampling(self, room: int) -> SamplingParams:
        """The sampling parameters; unset, the output may fill the ``room`` the context leaves (as in
        OpenAI's chat API)."""
        field = self._max_tokens_field
        max_tokens = getattr(self, field)
        if max_tokens is None:
            max_tokens = max(1, room)
        elif max_tokens < 1:
            raise SamplingError(f"{field} must be >= 1 (got {max_tokens})", field)
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class WeightsRequest(BaseModel):
    model_config = STRICT

    source: str  # a run directory, one of its checkpoints, or a Hugging Face directory
    version: int | None = Field(None, ge=1)  # default: the version served + 1; never lower than it
    # live: source is a training run's directory; the next weights its trainers publish, version = their step
    live: bool = False
    timeout: float | None = Field(None, gt=0, le=86400)  # live only: seconds to wait for that publish


def chat_prompt(messages: list[Message], chat: ChatFormat) -> str:
    """The prompt text of a conversation, rendered by the served model's chat format."""
    return chat.render([{"role": m.role, "content": message_text(m.content, i)} for i, m in enumerate(messages)])


def _fingerprint(versions: list[int]) -> dict:
    return {"system_fingerprint": f"stalwart-weights-v{versions[-1] if versions else 0}",
            "weight_versions": versions}


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _legacy_logprobs(choices, tokenizer) -> dict:
    tokens = [_token_text(tokenizer, c.token) for c in choices]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [c.logprob for c in choices],
            "top_logprobs": [_top_by_text(c.top, tokenizer) if c.top else None for c in choices],
            "text_offset": offsets}


def _top_by_text(top: list[tuple[int, float]], tokenizer) -> dict[str, float]:
    """The legacy format's top tokens, keyed by text: of tokens that decode alike (parts of one
    character), the most likely one's log-probability."""
    out: dict[str, float] = {}
    for t, lp in top:
        out.setdefault(_token_text(tokenizer, t), lp)
    return out


def _chat_logprobs(choices, tokenizer) -> dict:
    def entry(token: int, lp: float) -> dict:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**entry(c.token, c.logprob), "top_logprobs": [entry(t, lp) for t, lp in c.top or []]}
                        for c in choices]}


@dataclass(frozen=True)
class Draw:
    """One sequence generated for a request: draw ``j`` of prompt ``prompt``; ``lead`` is the position (in
    the request's list of draws) of the draw that computes and scores the shared prompt (None: itself)."""

    prompt: int
    j: int
    lead: int | None


def plan_draws(req: SamplingRequest, n_prompts: int, params: SamplingParams) -> tuple[list[Draw], list[SamplingParams]]:
    """Every draw of a request, prompt by prompt, with its sampling parameters."""
    draws, per_draw = [], []
    for i in range(n_prompts):
        first = len(draws)
        for j, p in enumerate(req.draw_params(params)):
            draws.append(Draw(i, j, first if j else None))
            per_draw.append(p)
    return draws, per_draw


def _prompt_entries(prompt: list[int], scores) -> list[Choice]:
    """The prompt's tokens as log-probability entries: the first has none (nothing precedes it)."""
    return [Choice(prompt[0])] + list(scores or [])


def _ranked(draws: list[int], results, n: int, best_of: int) -> list[int]:
    """The ``n`` draws to return: all of them, or with ``best_of > n`` those of highest mean log-probability."""
    if best_of <= n:
        return draws

    def mean_logprob(k: int) -> float:
        picked = [c.logprob for o in results[k][0] for c in o.choices]
        return sum(picked) / len(picked) if picked else 0.0

    return sorted(draws, key=mean_logprob, reverse=True)[:n]


def completion_response(rid: str, req, draws: list[Draw], jobs, results, prompts: list[list[int]],
                        texts: list[str], created: int, model: str, tokenizer) -> dict:
    """The completion of every prompt's returned draws; choice ``index`` = prompt * n + rank."""
    choices, versions = [], set()
    completion_tokens = sum(len(o.choices) for outs, _ in results for o in outs)
    for i, prompt in enumerate(prompts):
        mine = [k for k, d in enumerate(draws) if d.prompt == i]
        scores = next((o.prompt for o in results[mine[0]][0] if o.prompt is not None), None)
        for rank, k in enumerate(_ranked(mine, results, req.n, req.draws)):
            outs, last = results[k]
            versions.update(jobs[k].versions)
            picked = [c for o in outs for c in o.choices]
            text = "".join(o.text for o in outs)
            if req.echo:
                text, picked = texts[i] + text, _prompt_entries(prompt, scores) + picked
            choices.append({"index": i * req.n + rank, "text": text, "finish_reason": last.finish_reason,
                            "logprobs": _legacy_logprobs(picked, tokenizer) if req.logprobs is not None else None})
    prompt_tokens = sum(len(p) for p in prompts)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, **_fingerprint(sorted(versions)),
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


class CompletionStream:
    """The chunks of a streamed completion (``best_of`` is ``n`` here): a draw's first chunk starts with
    its prompt when ``echo`` asks (scored as the prompt's first draw scored it)."""

    def __init__(self, rid: str, created: int, model: str, tokenizer, req, draws: list[Draw],
                 prompts: list[list[int]], texts: list[str]) -> None:
        self.rid, self.created, self.model, self.tokenizer = rid, created, model, tokenizer
        self.req, self.draws, self.prompts, self.texts = req, draws, prompts, texts
        self.started: set[int] = set()
        self.scores: dict[int, list] = {}  # prompt -> its scores, from its first draw's first output

    def chunk(self, k: int, out) -> dict:
        d = self.draws[k]
        if out.prompt is not None:
            self.scores[d.prompt] = out.prompt
        text, picked = out.text, list(out.choices)
        if self.req.echo and k not in self.started:
            prompt = self.prompts[d.prompt]
            text, picked = self.texts[d.prompt] + text, _prompt_entries(prompt, self.scores.get(d.prompt)) + picked
        self.started.add(k)
        lp = _legacy_logprobs(picked, self.tokenizer) if self.req.logprobs is not None and picked else None
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                **_fingerprint([out.weight_version]),
                "choices": [{"index": d.prompt * self.req.n + d.j, "text": text, "logprobs": lp,
                             "finish_reason": out.finish_reason}]}


def chat_response(rid: str, req, jobs, results, prompt_tokens: int, created: int, model: str, tokenizer) -> dict:
    choices, versions = [], set()
    for rank, k in enumerate(_ranked(list(range(len(jobs))), results, req.n, req.draws)):
        outs, last = results[k]
        versions.update(jobs[k].versions)
        picked = [c for o in outs for c in o.choices]
        choices.append({"index": rank, "finish_reason": last.finish_reason,
                        "message": {"role": "assistant", "content": "".join(o.text for o in outs)},
                        "logprobs": _chat_logprobs(picked, tokenizer) if req.logprobs else None})
    completion_tokens = sum(len(o.choices) for outs, _ in results for o in outs)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            **_fingerprint(sorted(versions)), "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def chat_chunk(rid: str, created: int, model: str, index: int, out, tokenizer, logprobs: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            **_fingerprint([out.weight_version]),
            "choices": [{"index": index, "delta": {"role": "assistant", "content": out.text},
                         "logprobs": _chat_logprobs(out.choices, tokenizer) if logprobs and out.choices else None,
                         "finish_reason": out.finish_reason}]}


def usage_chunk(rid: str, kind: str, created: int, model: str, versions: list[int], prompt_tokens: int,
                completion_tokens: int) -> dict:
    """The last chunk of a stream asked for with ``stream_options.include_usage``: usage, no choices."""
    return {"id": rid, "object": kind, "created": created, "model": model, **_fingerprint(versions),
            "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                     "total_tokens": prompt_tokens + completion_tokens}}
