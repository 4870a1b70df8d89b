"""OpenAI's request and response shapes for completions and chat completions (the fields we honour).

Requests are pydantic models (a malformed body is a 400 naming the field); ranges are checked once,
by ``SamplingParams.validate``. Chat messages are rendered with a plain-text template,
``"<role>: <content>\\n"`` per message and ``"assistant:"`` last: Stalwart's models are base models with
no chat template of their own.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from stalwart.infer.sampling import SamplingError, SamplingParams
from stalwart.serve.formats import ResponseFormat, StructuredOutputs, constraint_of

# Strict: a value of the wrong JSON type is refused, not coerced ("5" is no max_tokens, true no 1).
STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False  # a last chunk with the whole request's usage (and no choices)


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
    ignore_eos: bool = False
    # a structured output (serve/formats.py): OpenAI's response_format, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def param_name(self, engine_name: str | None) -> str | None:
        """The request field behind an engine or sampling parameter (they differ in chat)."""
        return engine_name

    def _params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.n != 1:
            raise SamplingError(f"n must be 1 (got {self.n}); send separate requests for several samples", "n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, stop=stop, logprobs=logprobs, seed=self.seed,
                              ignore_eos=self.ignore_eos,
                              structured=constraint_of(self.response_format, self.structured_outputs))


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def sampling(self) -> SamplingParams:
        """The sampling parameters; max_tokens defaults to 16, as in OpenAI's completions API."""
        if self.echo:
            raise SamplingError("echo is not supported", "echo")
        return self._params(16 if self.max_tokens is None else self.max_tokens, self.logprobs)

    def token_prompts(self, tokenizer) -> list[list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [tokenizer.encode(p, add_special_tokens=False).ids]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        if not p:
            return [[]]
        return [tokenizer.encode(x, add_special_tokens=False).ids if isinstance(x, str) else list(x) for x in p]


class Message(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


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


def chat_prompt(messages: list[Message]) -> str:
    if not messages:
        raise SamplingError("messages must not be empty", "messages")
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"


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
            "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in c.top} if c.top else None for c in choices],
            "text_offset": offsets}


def _chat_logprobs(choices, tokenizer) -> dict:
    def entry(token: int, lp: float) -> dict:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**entry(c.token, c.logprob), "top_logprobs": [entry(t, lp) for t, lp in c.top or []]}
                        for c in choices]}


def completion_response(rid: str, jobs, results, prompts, created: int, model: str, tokenizer,
                        logprobs: int | None) -> dict:
    choices, completion_tokens, versions = [], 0, set()
    for i, (job, (outs, last)) in enumerate(zip(jobs, results)):
        picked = [c for o in outs for c in o.choices]
        completion_tokens += len(picked)
        versions.update(job.versions)
        choices.append({"index": i, "text": "".join(o.text for o in outs), "finish_reason": last.finish_reason,
                        "logprobs": _legacy_logprobs(picked, tokenizer) if logprobs is not None else None})
    prompt_tokens = sum(len(p) for p in prompts)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, **_fingerprint(sorted(versions)),
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def completion_chunk(rid: str, created: int, model: str, index: int, out, tokenizer) -> dict:
    lp = _legacy_logprobs(out.choices, tokenizer) if out.choices and out.choices[0].logprob is not None else None
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            **_fingerprint([out.weight_version]),
            "choices": [{"index": index, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}]}


def chat_response(rid: str, job, outs, last, prompt_tokens: int, created: int, model: str, tokenizer,
                  logprobs: bool) -> dict:
    picked = [c for o in outs for c in o.choices]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            **_fingerprint(job.versions),
            "choices": [{"index": 0, "finish_reason": last.finish_reason,
                         "message": {"role": "assistant", "content": "".join(o.text for o in outs)},
                         "logprobs": _chat_logprobs(picked, tokenizer) if logprobs else None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(picked),
                      "total_tokens": prompt_tokens + len(picked)}}


def chat_chunk(rid: str, created: int, model: str, out, tokenizer, logprobs: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            **_fingerprint([out.weight_version]),
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": out.text},
                         "logprobs": _chat_logprobs(out.choices, tokenizer) if logprobs and out.choices else None,
                         "finish_reason": out.finish_reason}]}


def usage_chunk(rid: str, kind: str, created: int, model: str, versions: list[int], prompt_tokens: int,
                completion_tokens: int) -> dict:
    """The last chunk of a stream asked for with ``stream_options.include_usage``: usage, no choices."""
    return {"id": rid, "object": kind, "created": created, "model": model, **_fingerprint(versions),
            "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                     "total_tokens": prompt_tokens + completion_tokens}}
