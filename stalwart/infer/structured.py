"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regular expression,
a grammar or a fixed set of choices, by a mask over the vocabulary the sampler applies to every token.

The constraint is compiled by llguidance (a maintained grammar library, on the host, no torch
dependency) against the served model's own tokenizer: ``Grammars`` builds llguidance's tokenizer once
from the ``tokenizers.Tokenizer`` the engine serves with (Stalwart's byte-level BPE from a run, or the
``tokenizer.json`` of a Hugging Face directory: one path for both), sized to the model's vocabulary, so
ids the tokenizer lacks (padding rows of the embedding) are never allowed.

Per request, ``GrammarState`` is the parser's position: before each token it yields the tokens that
keep the output a prefix of some string the constraint accepts (``allowed``), and it advances by the
token sampled. End of text is allowed only where the output is complete; once nothing but the end can
follow, the request finishes (``done``). The state is a pure function of the constraint and the
tokens generated so far: ``Grammars.start(constraint, generated)`` rebuilds it from those tokens, which
is how a request resumed elsewhere (its prompt plus the tokens it already has) gets its grammar back.
The mask applies to greedy decoding too; a request without a constraint samples exactly as before.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import llguidance
import numpy as np
import torch

from stalwart.infer.sampling import SamplingError

Kind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]

# Compact JSON: no whitespace between tokens, so a model cannot spend its budget on blank space.
JSON_OPTIONS = {"whitespace_flexible": False}
CACHE_SIZE = 256  # compiled grammars kept per engine, most recently used first


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match, and the request field that asked for it (for errors).

    ``text``: the schema as JSON for json_schema (``{"type": "object"}`` for json_object), the regular
    expression (Rust ``regex`` syntax, whole output), the grammar (Lark, or GBNF as llama.cpp writes
    it; llguidance reads both), or the choices as a JSON list of strings.
    """

    kind: Kind
    text: str
    param: str

    @staticmethod
    def json_schema(schema: dict | bool, param: str) -> "Constraint":
        return Constraint("json_schema", json.dumps(schema), param)

    @staticmethod
    def json_object(param: str) -> "Constraint":
        return Constraint("json_object", json.dumps({"type": "object"}), param)

    def grammar(self) -> str:
        """llguidance's grammar for this constraint (no tokenizer needed); raises ValueError if the
        constraint cannot be read."""
        if self.kind in ("json_schema", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        return llguidance.grammar_from("grammar" if self.kind == "grammar" else "choice", self.text)


class GrammarState:
    """One request's position in its constraint: the tokens allowed next, advanced by each token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """(vocab,) bool on the host: True where a token keeps the output on the constraint."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.vocab_size].view(np.bool_))

    def advance(self, token: int) -> None:
        """Consume the token sampled (one the mask allowed)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def rollback(self, tokens: int) -> None:
        """Undo the last ``tokens`` advances (speculative decoding's drafts, once checked)."""
        if tokens and not self.matcher.rollback(tokens):
            raise RuntimeError(f"the grammar could not roll back {tokens} tokens: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """Nothing but the end of text can follow: the output is complete."""
        return self.matcher.is_stopped()


class Grammars:
    """One engine's compiler of constraints: llguidance's tokenizer (built once, on first use) and the
    grammars compiled recently. Safe to call from the server's event loop (checking a request) and the
    engine thread (starting it) at once."""

    def __init__(self, tokenizer, eos_id: int | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer  # tokenizers.Tokenizer
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[Constraint, str] = OrderedDict()
        self._lock = threading.Lock()

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                if self.tokenizer is None or self.eos_id is None:
                    raise SamplingError("structured outputs need the model's tokenizer and an end-of-text token; "
                                        "this model has none", None)
                self._ll = llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                  eos_token=self.eos_id)
            return self._ll

    def compile(self, c: Constraint) -> str:
        """The constraint's grammar, checked against the tokenizer; a constraint llguidance cannot
        compile (bad syntax, a schema keyword it cannot enforce) is a SamplingError naming ``c.param``."""
        with self._lock:
            if c in self._compiled:
                self._compiled.move_to_end(c)
                return self._compiled[c]
        ll = self.ll_tokenizer()
        try:
            grammar = c.grammar()
        except (ValueError, TypeError) as e:
            raise SamplingError(f"{c.param}: {_one_line(e)}", c.param) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, ll)
        if error:
            raise SamplingError(f"{c.param}: {_one_line(error)}", c.param)
        with self._lock:
            self._compiled[c] = grammar
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return grammar

    def start(self, c: Constraint, generated: list[int] = ()) -> GrammarState:
        """A fresh state for ``c`` advanced over ``generated``, the tokens the request already has."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), self.compile(c), log_level=0)
        if matcher.is_error():
            raise SamplingError(f"{c.param}: {_one_line(matcher.get_error())}", c.param)
        state = GrammarState(matcher, self.vocab_size)
        if generated and not matcher.consume_tokens(list(generated)):
            raise SamplingError(f"{c.param}: the {len(generated)} tokens already generated do not follow it "
                                f"({_one_line(matcher.get_error())})", c.param)
        return state


def _one_line(e: object) -> str:
    return " ".join(str(e).split())
