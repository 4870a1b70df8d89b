"""The OpenAI API's sampling and scoring fields, spoken to with OpenAI's own client against one in-process
server (the real app and engine on a tiny model): echo with prompt log-probabilities equal to the
training forward's, max_tokens 0 with echo, n and best_of (seeded per choice, the prompt computed once),
logit_bias, stop token ids, min_tokens, presence and frequency penalties, chat content parts and a
model's own chat template; every field out of range a 400 naming it. lm-evaluation-harness against
`stalwart serve` is in test_serve_lm_eval.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from test_serve_app import ARGS, InProcessServer, error, tokenizer  # noqa: F401 - tokenizer is a fixture

from stalwart.config.serve import EngineConfig
from plain_generate import sample
from stalwart.infer.engine import Engine
from stalwart.infer.sampling import SamplingParams, adjust_logits, choice_seed
from stalwart.models.llama import Transformer
from stalwart.serve.chat import ChatFormat
from stalwart.train.init import materialize_and_init

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.unit

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
PROMPT = "import json\nclass Foo(object):\n    def __init__(self, x):\n"


ARGS128 = dataclasses.replace(ARGS, max_seq_len=128)


@pytest.fixture(scope="module")
def server(tokenizer):  # noqa: F811
    s = InProcessServer(tokenizer, EngineConfig(max_seqs=8, max_batch_tokens=64, max_queue=32, kv_cache_mb=4,
                                                block_size=4), chat=ChatFormat(TEMPLATE, {"bos_token": "#"}),
                        args=ARGS128)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference() -> Transformer:
    """The served weights (seed 0) in a plain model: the training forward and `stalwart generate`."""
    with torch.device("meta"):
        model = Transformer(ARGS128)
    materialize_and_init(model, torch.device("cpu"), 0)
    return model.eval()


def tokens_of(server, text: str) -> list[int]:
    return server.engine.tokenizer.encode(text, add_special_tokens=False).ids


def complete(server, **body) -> dict:
    r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_scores_the_prompt_as_the_training_forward_does(server, reference):
    ids = tokens_of(server, PROMPT)
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([ids])).float(), -1)[0]
    for max_tokens in (0, 2):
        r = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, echo=True,
                                             logprobs=2, temperature=0)
        c = r.choices[0]
        lp = c.logprobs
        assert c.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for k in range(1, len(ids)):
            assert abs(lp.token_logprobs[k] - float(logp[k - 1, ids[k]])) < 1e-5
            # (keyed by text: two tokens that decode alike, parts of one character, share an entry)
            assert max(lp.top_logprobs[k].values()) == pytest.approx(float(logp[k - 1].max()), abs=1e-5)
        assert r.usage.completion_tokens == max_tokens and r.usage.prompt_tokens == len(ids)
    # Token-id prompts (lm-evaluation-harness sends these), several in one request, scored alike.
    both = complete(server, prompt=[ids, ids[:5]], max_tokens=0, echo=True, logprobs=1)["choices"]
    assert [c["index"] for c in both] == [0, 1]
    assert both[0]["logprobs"]["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-6)
    assert len(both[1]["logprobs"]["tokens"]) == 5
    # echo without logprobs: the prompt's text, no scores.
    assert complete(server, echo=True, max_tokens=0)["choices"][0] == {
        "index": 0, "text": PROMPT, "finish_reason": "length", "logprobs": None}


def test_prompt_scores_survive_chunked_prefill_and_preemption(tokenizer, reference):  # noqa: F811
    # The engine tests' cache-pressure setting: a budget of 24 tokens cuts the longer prompts into chunks,
    # and a cache of some 100 tokens cannot hold 8 running requests' growth, so some are preempted and
    # recompute their prompts.
    with torch.device("meta"):
        model = Transformer(ARGS128)
    materialize_and_init(model, torch.device("cpu"), 0)
    engine = Engine(model.eval(), tokenizer, None, EngineConfig(block_size=4, max_batch_tokens=24, max_seqs=8,
                                                                  kv_cache_mb=0.05))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, ARGS.vocab_size, (n,), generator=g).tolist()
               for n in (20, 15, 22, 9, 17, 12, 5, 23, 2, 13, 30, 45)]
    for i, p in enumerate(prompts):
        engine.add(str(i), p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=1))
    scores = {}
    while engine.has_work():
        for o in engine.step():
            if o.prompt is not None:
                scores[o.rid] = o.prompt
    assert engine.stats()["preemptions"] > 0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            logp = torch.log_softmax(reference(torch.tensor([p])).float(), -1)[0]
        got = scores[str(i)]
        assert [c.token for c in got] == p[1:]
        assert max(abs(c.logprob - float(logp[k, p[k + 1]])) for k, c in enumerate(got)) < 1e-5
        assert [c.top[0][0] for c in got] == logp[:-1].argmax(-1).tolist()


def test_n_and_best_of_draw_seeded_choices_from_one_computed_prompt(server):
    before = server.engine.stats()["prefix_cached_tokens"]
    three = complete(server, n=3, seed=11, logprobs=0, temperature=1.0)
    cached = server.engine.stats()["prefix_cached_tokens"] - before
    # Choices 1 and 2 mapped the first choice's cached prompt blocks instead of computing them.
    assert cached >= 2 * ((len(tokens_of(server, PROMPT)) - 1) // 4) * 4 > 0
    texts = [c["text"] for c in three["choices"]]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2] and len(set(texts)) > 1
    assert three["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in three["choices"])
    # Choice 0 is what n = 1 draws with the same seed; every choice is reproducible.
    assert complete(server, seed=11, temperature=1.0)["choices"][0]["text"] == texts[0]
    assert [c["text"] for c in complete(server, n=3, seed=11, temperature=1.0)["choices"]] == texts
    assert choice_seed(11, 0) == 11 and choice_seed(11, 1) != choice_seed(11, 2)
    # best_of 3, n 1: the draw with the highest mean log-probability, among the same three.
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in three["choices"]]
    best = complete(server, n=1, best_of=3, seed=11, temperature=1.0)["choices"]
    assert len(best) == 1 and best[0]["text"] == texts[means.index(max(means))] and best[0]["logprobs"] is None
    # Several prompts: choice index = prompt * n + rank; echo with n gives each choice the prompt's scores.
    two = complete(server, prompt=["def", "import"], n=2, seed=3, echo=True, logprobs=0, max_tokens=2,
                   ignore_eos=True)["choices"]
    assert [c["index"] for c in two] == [0, 1, 2, 3]
    lengths = [len(tokens_of(server, p)) + 2 for p in ("def", "import") for _ in range(2)]
    assert [len(c["logprobs"]["token_logprobs"]) for c in two] == lengths  # the prompt's and 2 generated
    assert two[0]["logprobs"]["token_logprobs"][:-2] == two[1]["logprobs"]["token_logprobs"][:-2]
    chat = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                                 seed=5, max_tokens=4)
    assert [c.index for c in chat.choices] == [0, 1]
    streamed = list(server.client.completions.create(model="tiny", prompt="def", n=2, seed=3, max_tokens=3,
                                                     stream=True, extra_body={"ignore_eos": True}))
    assert {c.choices[0].index for c in streamed} == {0, 1}


def test_logit_bias_stop_token_ids_min_tokens_and_penalties(server, reference):
    prompt = tokens_of(server, PROMPT)
    greedy = sample(reference, prompt, 8, ARGS128.max_seq_len, temperature=0.0)
    decode = server.engine.tokenizer.decode

    def ids(**body) -> dict:
        """The greedy choice served for the prompt with these fields."""
        return complete(server, **{"prompt": prompt, "temperature": 0, "ignore_eos": True, "max_tokens": 8,
                                   **body})["choices"][0]

    assert ids()["text"] == decode(greedy)
    # A token forced by +100; the greedy first token forbidden by -100.
    assert ids(logit_bias={"7": 100})["text"] == decode([7] * 8)
    assert not ids(logit_bias={str(greedy[0]): -100}, max_tokens=1)["text"] == decode(greedy[:1])
    # A stop token ends the output like the end of text (its text not shown); min_tokens holds it off.
    stop = greedy[2]
    stopped = ids(stop_token_ids=[stop], logprobs=0)
    cut = greedy.index(stop)
    assert stopped["finish_reason"] == "stop" and stopped["text"] == decode(greedy[:cut])
    assert len(stopped["logprobs"]["tokens"]) == cut + 1
    held = ids(stop_token_ids=[greedy[0]], min_tokens=3, logprobs=0)
    assert len(held["logprobs"]["tokens"]) >= 3 and held["text"] != decode(greedy)
    # Penalties, in OpenAI's form: the frequency penalty grows with a token's count.
    logits = torch.zeros(ARGS.vocab_size)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={3: 1.0}, min_tokens=4,
                       stop_token_ids=[9])
    out = adjust_logits(logits, p, [1, 1, 2], eos_id=5)
    assert out[1] == -1.25 and out[2] == -0.75 and out[3] == 1.0 and out[5] == out[9] == float("-inf")
    assert adjust_logits(logits, p, [1, 1, 2, 4], eos_id=5)[5] == 0.0  # min_tokens reached
    assert adjust_logits(logits, SamplingParams(), [1, 1], eos_id=5) is logits  # untouched when unset
    if len(set(greedy)) < len(greedy):  # the greedy output repeats a token: a penalty changes it
        assert ids(frequency_penalty=2.0, presence_penalty=2.0)["text"] != decode(greedy)


def test_chat_takes_content_parts_and_the_models_template(server, tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f"}]
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "def"}, {"type": "text", "text": "f"}]}]
    a = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    b = server.client.chat.completions.create(model="tiny", messages=parts, max_tokens=4, temperature=0)
    rendered = "#<system>be brief</system><user>def f</user><assistant>"
    assert a.usage.prompt_tokens == len(tokens_of(server, rendered))
    assert b.usage.prompt_tokens == len(tokens_of(server, rendered.replace("def f", "def\nf")))
    assert a.choices[0].message.content  # the model answered something
    # Only text parts; a template's own refusal is a 400 naming messages.
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert error(r)[:2] == (400, "messages") and "only text parts" in error(r)[2]
    # The template a Hugging Face directory ships: chat_template.jinja first, then tokenizer_config.json.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default", "template":
        "{{ raise_exception('no') if messages[0]['role'] == 'tool' }}{{ messages[0]['content'] }}|"}],
        "bos_token": {"content": "<s>"}}))
    fmt = ChatFormat.of_dir(tmp_path)
    assert fmt.render([{"role": "user", "content": "x"}]) == "x|" and fmt.special == {"bos_token": "<s>"}
    with pytest.raises(ValueError, match="refused them: no"):
        fmt.render([{"role": "tool", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages | length }}")
    assert ChatFormat.of_dir(tmp_path).render([{"role": "user", "content": "x"}]) == "<s>1"
    assert ChatFormat.of_dir(None).render(messages) == "system: be brief\nuser: def f\nassistant:"


BAD = [  # (path, body, the param the error names, part of its message)
    ("/v1/completions", {"prompt": "def", "max_tokens": 0}, "max_tokens", "0 only with echo"),
    ("/v1/completions", {"prompt": "def", "best_of": 1, "n": 2}, "best_of", "best_of must be in [n = 2, 16]"),
    ("/v1/completions", {"prompt": "def", "best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
    ("/v1/completions", {"prompt": "def", "logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
    ("/v1/completions", {"prompt": "def", "logit_bias": {"5": 101}}, "logit_bias", "in [-100, 100]"),
    ("/v1/completions", {"prompt": "def", "logit_bias": {"384": 1}}, "logit_bias", "not in [0, 384)"),
    ("/v1/completions", {"prompt": "def", "stop_token_ids": [-1]}, "stop_token_ids", "not in [0, 384)"),
    ("/v1/completions", {"prompt": "def", "stop_token_ids": ["a"]}, "stop_token_ids", "valid integer"),
    ("/v1/completions", {"prompt": "def", "presence_penalty": 2.5}, "presence_penalty", "in [-2, 2]"),
    ("/v1/completions", {"prompt": "def", "frequency_penalty": -3}, "frequency_penalty", "in [-2, 2]"),
    ("/v1/completions", {"prompt": "def", "min_tokens": 20, "max_tokens": 4}, "min_tokens", "min_tokens must be in"),
    ("/v1/completions", {"prompt": "def", "echo": True, "logprobs": 21}, "logprobs", "in [0, 20]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0,
                              "max_tokens": 5}, "max_completion_tokens", "max_completion_tokens must be >= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n", "n must be in [1, 16]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 9, "max_tokens": 8},
     "min_tokens",
     "min_tokens must be in"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages", "messages"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 16}, "n", "48 sequences (prompts x n or best_of)"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "best_of": 16}, "best_of", "queues at most 32"),
]


@pytest.mark.parametrize("path,body,param,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_field_is_a_400_naming_it(server, path, body, param, message):
    status, got_param, got = error(server.post(path, body))
    assert (status, got_param) == (400, param) and message in got, got
