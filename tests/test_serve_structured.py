"""Structured outputs through the server: JSON schemas, any JSON object, regular expressions, grammars
(Lark and GBNF) and choices, asked for with OpenAI's ``response_format`` or vLLM's ``structured_outputs``,
over OpenAI's own client, streamed or not, sampled with many seeds and greedily. The model is tiny and
untrained, so its text is noise: the mask alone makes every finished output parse and validate, and an
output cut by ``max_tokens`` says so (``finish_reason`` "length") and is still a prefix of the language.
One in-process server (the real app and engine behind uvicorn) serves the whole module."""

from __future__ import annotations

import json
import re
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import llguidance
import pytest
import torch

from inproc_server import serve_in_process
from stalwart.config.serve import EngineConfig
from stalwart.data.tokenizer import eos_id, train_bpe
from stalwart.generate import next_token
from stalwart.infer.engine import Engine
from stalwart.infer.sampling import SamplingParams
from stalwart.infer.structured import Constraint, Grammars
from stalwart.models.flavors import TransformerArgs
from stalwart.models.llama import Transformer
from stalwart.runtime.device import host_generator
from stalwart.train.init import materialize_and_init

pytestmark = pytest.mark.unit

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=384, ffn_hidden=128,
                       max_seq_len=256, init_std=0.4)
SEEDS = range(6)
MAX_TOKENS = 160

# Bounded schemas (strings with maxLength, bounded integers and arrays, closed objects): any path through
# them ends, so every output must finish within MAX_TOKENS and validate.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}},
     "required": ["ok", "level"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "note": {"type": "string", "maxLength": 4}},
     "required": ["point", "tags"], "additionalProperties": False},
    {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"type": "string", "pattern": "^[a-f0-9]{4}$"}]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "kind": {"const": "item"}},
     "required": ["id", "kind"], "additionalProperties": False},
]
REGEX = r"[0-9]{3}-[a-z]{2,5}(\.[a-z]{1,3})?"
LARK = 'start: greeting " " NAME\ngreeting: "hello" | "hi"\nNAME: /[a-z]{1,6}/'
GBNF = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
GRAMMARS = [(LARK, r"(hello|hi) [a-z]{1,6}"), (GBNF, r"(yes|no) [0-9][0-9]?")]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [p.read_text() for p in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))]
    return train_bpe(texts, ARGS.vocab_size)


@pytest.fixture(scope="module")
def server(tokenizer):
    with torch.device("meta"):
        model = Transformer(ARGS)
    materialize_and_init(model, torch.device("cpu"), 0)
    engine = Engine(model.eval(), tokenizer, eos_id(tokenizer), EngineConfig(max_seqs=16, kv_cache_mb=8))
    with serve_in_process(engine) as served:
        yield served


def _chat(client, seed, **extra):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "give me data"}],
                                       max_tokens=MAX_TOKENS, seed=seed, temperature=0.0 if seed is None else 1.0,
                                       **extra)
    return r.choices[0].message.content, r.choices[0].finish_reason


def _completion(client, seed, stream=False, max_tokens=MAX_TOKENS, **extra):
    kw = dict(model="tiny", prompt="def f(x):", max_tokens=max_tokens, seed=seed,
              temperature=0.0 if seed is None else 1.0, extra_body=extra)
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.completions.create(stream=True, **kw):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


def _many(calls):
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda c: c(), calls))


def test_json_schemas_validate_for_every_seed_greedy_and_stream(server):
    _, client = server
    calls, schemas = [], []
    for schema in SCHEMAS:
        for seed in [None, *SEEDS]:
            fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
            calls.append(lambda s=seed, f=fmt: _chat(client, s, response_format=f))
            calls.append(lambda s=seed, sc=schema: _completion(client, s, stream=s in (None, 0),
                                                               structured_outputs={"json": sc}))
            schemas += [schema, schema]
    results = _many(calls)
    for schema, (text, reason) in zip(schemas, results):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    # Not one value over and over: the seeds reach different outputs.
    assert len({text for text, _ in results}) > len(SCHEMAS) * 3


def test_streamed_equals_whole_and_seed_repeats(server):
    _, client = server
    schema = SCHEMAS[3]
    whole = _completion(client, 7, structured_outputs={"json": json.dumps(schema)})
    assert _completion(client, 7, stream=True, structured_outputs={"json": schema}) == whole
    jsonschema.validate(json.loads(whole[0]), schema)


def test_json_object_regex_grammar_choice(server, tokenizer):
    _, client = server
    calls, checks = [], []
    for seed in [None, *SEEDS]:
        calls.append(lambda s=seed: _chat(client, s, response_format={"type": "json_object"}))
        checks.append(("json_object", None))
        calls.append(lambda s=seed: _completion(client, s, structured_outputs={"json_object": True}))
        checks.append(("json_object", None))
        calls.append(lambda s=seed: _completion(client, s, structured_outputs={"regex": REGEX}))
        checks.append(("regex", REGEX))
        for grammar, pattern in GRAMMARS:
            calls.append(lambda s=seed, g=grammar: _chat(client, s, extra_body={"structured_outputs": {"grammar": g}}))
            checks.append(("grammar", pattern))
        calls.append(lambda s=seed: _completion(client, s, stream=True,
                                                structured_outputs={"choice": ["red", "green", "blue"]}))
        checks.append(("choice", "red|green|blue"))
    finished = 0
    for (kind, pattern), (text, reason) in zip(checks, _many(calls)):
        if kind == "json_object":
            # Any object is unbounded: an untrained model may not close it within max_tokens. Then
            # the output says "length" and is a prefix of some JSON object.
            if reason == "length":
                assert_prefix(tokenizer, Constraint.json_object("t"), text)
                continue
            assert reason == "stop" and isinstance(json.loads(text), dict), text
            finished += 1
        else:
            assert reason == "stop" and re.fullmatch(pattern, text), (kind, text, reason)
    assert finished >= 1  # some objects close ({} at least)


def assert_prefix(tokenizer, c: Constraint, text: str) -> None:
    """``text`` (possibly cut inside a character) is a prefix of a string ``c`` accepts."""
    ll = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=ARGS.vocab_size, eos_token=eos_id(tokenizer))
    matcher = llguidance.LLMatcher(ll, c.grammar(), log_level=0)
    assert matcher.consume_tokens(ll.tokenize_str(text.rstrip("\ufffd"))), (text, matcher.get_error())
    assert not matcher.is_error()


def test_max_tokens_cuts_output_with_length(server, tokenizer):
    _, client = server
    schema = SCHEMAS[0]
    for seed in SEEDS:
        text, reason = _completion(client, seed, max_tokens=4, structured_outputs={"json": schema})
        assert reason == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)
        assert_prefix(tokenizer, Constraint.json_schema(schema, "t"), text)


BAD = [  # (body fields, the param the 400 names, part of its message)
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", "objectx"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type: Input should be"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", ""),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar", "missing_rule"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not JSON"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "send one"),
]


@pytest.mark.parametrize("fields,param,message", BAD)
def test_bad_constraint_is_400_naming_the_field(server, fields, param, message):
    url, _ = server
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(url + path, json={**body, **fields}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], error


def test_text_format_is_free(server):
    url, _ = server
    body = {"prompt": "def f(x):", "max_tokens": 8, "seed": 3}
    free = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    texted = httpx.post(url + "/v1/completions", json={**body, "response_format": {"type": "text"}},
                        timeout=60).json()["choices"][0]["text"]
    assert free == texted


def test_mask_in_the_sampler_and_rebuilt_state(tokenizer):
    """The one sampler draws only allowed tokens (greedy and sampled; without a mask it is unchanged),
    and a state rebuilt from the tokens generated so far allows exactly what the live one does."""
    torch.manual_seed(0)
    logits = torch.randn(ARGS.vocab_size)
    allowed = torch.zeros(ARGS.vocab_size, dtype=torch.bool)
    allowed[[5, 17, 300]] = True
    assert next_token(logits, 0.0, 0, 1.0, host_generator(0), allowed) == int(torch.argmax(
        logits.masked_fill(~allowed, float("-inf"))))
    draws = {next_token(logits, 1.0, 0, 1.0, host_generator(s), allowed) for s in range(50)}
    assert draws <= {5, 17, 300} and len(draws) > 1
    a, b = host_generator(1), host_generator(1)
    assert [next_token(logits, 0.9, 40, 0.9, a) for _ in range(20)] == \
           [next_token(logits, 0.9, 40, 0.9, b, None) for _ in range(20)]

    grammars = Grammars(tokenizer, eos_id(tokenizer), ARGS.vocab_size)
    c = Constraint.json_schema(SCHEMAS[3], "t")
    live, gen, generated = grammars.start(c), host_generator(5), []
    while not live.done and len(generated) < 60:
        token = next_token(torch.randn(ARGS.vocab_size, generator=gen), 1.0, 0, 1.0, gen, live.allowed())
        live.advance(token)
        generated.append(token)
        if len(generated) % 7 == 0:
            assert torch.equal(grammars.start(c, generated).allowed(), live.allowed())
    assert live.done
    jsonschema.validate(json.loads(tokenizer.decode(generated)), SCHEMAS[3])
    with pytest.raises(ValueError, match="tokens already generated do not follow"):
        grammars.start(c, tokenizer.encode("[1]").ids)


def test_engine_refuses_bad_constraint_before_queueing(tokenizer):
    with torch.device("meta"):
        model = Transformer(ARGS)
    materialize_and_init(model, torch.device("cpu"), 0)
    engine = Engine(model.eval(), tokenizer, eos_id(tokenizer), EngineConfig(kv_cache_mb=1))
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        engine.add("a", [1, 2], SamplingParams(structured=Constraint("regex", "(", "structured_outputs.regex")))
    assert not engine.has_work()
