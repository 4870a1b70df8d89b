"""Speculative decoding by prompt lookup and by a draft model: the proposers, verification's
distribution (a chi-square test against the target distribution, with temperature, top-k and top-p),
and the engine: greedy output identical with and without speculation (batched, alone, sharing cached
prefixes), seeded sampling distributed as without it, and drafts actually proposed and kept; through
the server (OpenAI's client), whole and streamed, several tokens to a chunk; a draft model with
another vocabulary refused in one line by `stalwart serve`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch

from inproc_server import serve_in_process
from stalwart.config.serve import EngineConfig, ServeConfig
from stalwart.data.tokenizer import eos_id, train_bpe
from stalwart.generate import filter_logits
from stalwart.infer.engine import Engine
from stalwart.infer.sampling import SamplingParams
from stalwart.errors import UserError
from stalwart.export.hf import export_hf
from stalwart.infer.speculative import DraftModelProposer, load_draft_model, propose_ngram, verify
from stalwart.infer.structured import Constraint
from stalwart.models.flavors import TransformerArgs
from stalwart.models.llama import Transformer
from stalwart.runtime.device import host_generator
from stalwart.train.init import materialize_and_init

pytestmark = pytest.mark.unit

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=384, ffn_hidden=128,
                       max_seq_len=256, init_std=0.4)
P_MIN = 1e-3  # a chi-square p-value below this fails (the draws are seeded: a pass is repeatable)


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of counts ``observed`` against ``expected`` (same total)."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token the target gives no probability was drawn"
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_propose_ngram():
    assert propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], 3, 2) == [4, 9]
    assert propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], 3, 10) == [4, 9, 1, 2, 3]
    assert propose_ngram([5, 1, 2, 7, 8, 1, 2, 6, 2], 3, 2) == [6, 2]  # the latest occurrence of "2"
    assert propose_ngram([5, 1, 2, 7, 3, 1, 2], 3, 3) == [7, 3, 1]  # "1 2" matches, "5 1 2" does not
    assert propose_ngram([1, 2, 3], 3, 4) == []
    assert propose_ngram([7], 3, 4) == []
    assert propose_ngram([4, 4, 4], 2, 3) == [4]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)])
def test_verify_keeps_the_target_distribution(temperature, top_k, top_p):
    """Drafts [d1, d2] checked against rows r0, r1, r2: the first token is distributed as p0, the second
    (after d1 was kept) as p1, the third (after both) as p2, whatever the drafts' own probabilities."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 8, generator=gen) * 1.5
    drafts = [2, 5]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    target = [torch.softmax(filter_logits(r, temperature, top_k, top_p), -1) for r in rows]
    counts = [torch.zeros(8) for _ in range(3)]
    gen = host_generator(1)
    trials = 6000
    for _ in range(trials):
        out = verify(rows, drafts, params, gen)
        for i, token in enumerate(out):
            counts[i][token] += 1
        assert out[:-1] == drafts[:len(out) - 1]  # the kept tokens are a prefix of the drafts
    reached = [trials, counts[0][drafts[0]], counts[1][drafts[1]]]  # trials that got to position i
    for i in range(3):
        assert counts[i].sum() == reached[i]
        assert chi_square_p(counts[i], target[i] * reached[i]) > P_MIN, (i, counts[i], target[i])


def test_verify_greedy_keeps_agreeing_drafts():
    rows = torch.full((4, 6), -5.0)
    rows[0, 1] = rows[1, 3] = rows[2, 0] = rows[3, 4] = 5.0  # most likely: 1, 3, 0, 4
    greedy = SamplingParams(temperature=0.0)
    assert verify(rows, [1, 3, 0], greedy, host_generator(0)) == [1, 3, 0, 4]
    assert verify(rows, [1, 2, 0], greedy, host_generator(0)) == [1, 3]
    assert verify(rows, [5, 3, 0], greedy, host_generator(0)) == [1]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    texts = [p.read_text() for p in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))]
    tok = train_bpe(texts, ARGS.vocab_size)
    with torch.device("meta"):
        model = Transformer(ARGS)
    materialize_and_init(model, torch.device("cpu"), 0)
    return model.eval(), tok


DRAFT_ARGS = TransformerArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=ARGS.vocab_size,
                             ffn_hidden=64, max_seq_len=256, init_std=0.4)


def new_model(args: TransformerArgs, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    materialize_and_init(model, torch.device("cpu"), seed)
    return model.eval()


@pytest.fixture(scope="module")
def drafts():
    """Draft models: a copy of the target's weights (its guesses are the target's own: nearly all kept)
    and a smaller model of its own (few kept)."""
    return {"same": new_model(ARGS), "small": new_model(DRAFT_ARGS, seed=3)}


CODE = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
        "for i in range(10):\n    print(i)\nfor i in range(10):\n",
        "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,",
        "class A:\n    pass\n",
        "import json\nimport json\nimport os\nimport",
        "if x:\n    y = x\nelse:\n    y = x\n"]


def run(model, tok, speculative: str, params: list[SamplingParams], prompts: list[str], together: bool = True,
        draft=None, **cfg) -> tuple[list[list[int]], Engine]:
    engine = Engine(model, tok, eos_id(tok), EngineConfig(kv_cache_mb=8, speculative=speculative, **cfg),
                    draft=draft)
    out = {}

    def drain():
        while engine.has_work():
            for o in engine.step():
                out.setdefault(o.rid, []).extend(c.token for c in o.choices)

    for i, (p, prompt) in enumerate(zip(params, prompts)):
        engine.add(str(i), tok.encode(prompt).ids, p)
        if not together:
            drain()
    drain()
    return [out[str(i)] for i in range(len(prompts))], engine


@pytest.mark.parametrize("together", [True, False])
def test_greedy_output_is_identical(model_and_tokenizer, together):
    model, tok = model_and_tokenizer
    prompts = CODE + CODE[:2]  # repeated prompts: the second ones map the first ones' cached blocks
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True) for _ in prompts]
    plain, _ = run(model, tok, "off", params, prompts, together)
    for tokens, ngram in ((4, 3), (2, 1), (8, 2)):
        spec, engine = run(model, tok, "ngram", params, prompts, together, speculative_tokens=tokens,
                           speculative_ngram=ngram, block_size=4)
        assert spec == plain, (tokens, ngram)
        stats = engine.stats()
        assert stats["speculative_proposed"] > 0 and stats["speculative_accepted"] > 0, stats


def assert_same_law(plain: list[list[int]], spec: list[list[int]]) -> None:
    """Each position's tokens over many seeds, with and without speculation: the same distribution
    (two-sample chi-square over the tokens that both draw)."""
    for pos in range(1, len(plain[0])):
        a = torch.bincount(torch.tensor([t[pos] for t in plain]), minlength=ARGS.vocab_size).double()
        b = torch.bincount(torch.tensor([t[pos] for t in spec]), minlength=ARGS.vocab_size).double()
        both = (a + b) > 0
        a, b = a[both], b[both]
        # Two samples of equal size: expected counts are the pooled halves.
        pooled = (a + b) / 2
        stat = float((((a - pooled) ** 2 + (b - pooled) ** 2) / pooled).sum())
        df = int(both.sum()) - 1
        p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                          torch.tensor(stat / 2, dtype=torch.float64))) if df > 0 else 1.0
        assert p > P_MIN, (pos, a, b)


SEEDED = [SamplingParams(max_tokens=6, temperature=0.8, top_k=3, seed=s, ignore_eos=True) for s in range(300)]


@pytest.fixture(scope="module")
def plain_seeded(model_and_tokenizer):
    model, tok = model_and_tokenizer
    return run(model, tok, "off", SEEDED, [CODE[2]] * len(SEEDED))[0]


def test_seeded_sampling_keeps_the_distribution(model_and_tokenizer, plain_seeded):
    """The k-th token over many seeds, with and without speculation: the same distribution."""
    model, tok = model_and_tokenizer
    spec, engine = run(model, tok, "ngram", SEEDED, [CODE[2]] * len(SEEDED), speculative_tokens=3)
    assert engine.stats()["speculative_accepted"] > 0
    assert spec != plain_seeded  # other draws, same law
    assert_same_law(plain_seeded, spec)


def test_requests_that_cannot_speculate_decode_one_token_a_step(model_and_tokenizer):
    model, tok = model_and_tokenizer
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logit_bias={5: 1.0})]
    plain, _ = run(model, tok, "off", params, CODE[:2])
    spec, engine = run(model, tok, "ngram", params, CODE[:2])
    assert spec == plain and engine.stats()["speculative_proposed"] == 0


def test_through_the_server_whole_and_streamed(model_and_tokenizer):
    """A server speculating answers greedy completions with the text an engine without speculation
    makes, whole and streamed (a step's kept drafts arrive in one chunk), and counts every token."""
    model, tok = model_and_tokenizer
    prompts = CODE[:4]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) for _ in prompts]
    plain, _ = run(model, tok, "off", params, prompts)
    engine = Engine(model, tok, eos_id(tok), EngineConfig(kv_cache_mb=8, speculative="ngram"))
    chunks = 0
    with serve_in_process(engine) as (url, client):
        for prompt, expect in zip(prompts, plain):
            kw = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0.0, extra_body={"ignore_eos": True})
            r = client.completions.create(**kw)
            assert r.choices[0].text == tok.decode(expect) and r.usage.completion_tokens == 40
            streamed = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
            assert "".join(streamed) == tok.decode(expect)
            chunks += len(streamed)
        # Time per output token is observed once per token, kept drafts included (39 per request).
        metrics = httpx.get(url + "/metrics").text
        tpot = re.search(r"^stalwart_serve_time_per_output_token_seconds_count{[^}]*} (\S+)$", metrics, re.M)
        assert float(tpot.group(1)) == 2 * len(prompts) * 39
        # The drafts kept so far, as the engine counts them (updated after each step's outputs are out).
        deadline = time.monotonic() + 10
        while True:
            text = httpx.get(url + "/metrics").text
            kept = re.search(r'^stalwart_serve_speculative_drafts{kind="kept",[^}]*} (\S+)$', text, re.M)
            if kept and float(kept.group(1)) == engine.stats()["speculative_accepted"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert float(kept.group(1)) == engine.stats()["speculative_accepted"] > 0
    assert engine.stats()["speculative_accepted"] > 0 and chunks < 4 * 40


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                    "maxItems": 3},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "tags", "size"], "additionalProperties": False}


def test_structured_outputs_speculate_under_their_grammar(model_and_tokenizer):
    """A JSON-schema request speculates (its keys repeat the prompt's): greedy output identical to no
    speculation, sampled outputs valid for every seed, and the drafts the grammar refuses never kept."""
    model, tok = model_and_tokenizer
    example = '{"name":"ab","tags":["x","y"],"size":7}\n' * 2
    c = Constraint.json_schema(SCHEMA, "t")
    greedy = [SamplingParams(max_tokens=80, temperature=0.0, structured=c) for _ in range(3)]
    prompts = [example, example + "{", CODE[0]]
    plain, _ = run(model, tok, "off", greedy, prompts)
    spec, engine = run(model, tok, "ngram", greedy, prompts)
    assert spec == plain and engine.stats()["speculative_accepted"] > 0
    sampled = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured=c) for s in range(16)]
    outs, engine = run(model, tok, "ngram", sampled, [example] * 16)
    assert engine.stats()["speculative_accepted"] > 0
    for tokens in outs:
        jsonschema.validate(json.loads(tok.decode(tokens)), SCHEMA)


def test_draft_model_proposer_extends_each_window_greedily(drafts):
    """Each sequence's drafts are the draft model's greedy continuation of its latest ``window`` tokens,
    however many sequences share the pass, and never more than its room."""
    draft = drafts["small"]
    proposer = DraftModelProposer(draft, window=5)
    contexts = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2, 8, 1], [6, 6], [9]]
    rooms = [3, 2, 4, 0]
    with torch.inference_mode():
        got = proposer(contexts, rooms)
        for c, r, g in zip(contexts, rooms, got):
            x = list(c[-5:])
            for _ in range(r):
                x.append(int(draft(torch.tensor([x]))[0, -1].argmax()))
            assert g == x[len(c[-5:]):], (c, r, g)


@pytest.mark.parametrize("together", [True, False])
def test_draft_model_greedy_output_is_identical(model_and_tokenizer, drafts, together):
    """Greedy output with a draft model proposing is the output without speculation, whether the draft
    guesses well (the target's own weights: nearly every draft kept) or badly (a smaller model)."""
    model, tok = model_and_tokenizer
    prompts = CODE + CODE[:2]
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True) for _ in prompts]
    plain, _ = run(model, tok, "off", params, prompts, together)
    for name, tokens, window in (("same", 4, 256), ("small", 3, 16)):
        spec, engine = run(model, tok, "draft", params, prompts, together, draft=drafts[name],
                           speculative_tokens=tokens, draft_window=window, draft_model="unused", block_size=4)
        assert spec == plain, name
        stats = engine.stats()
        assert stats["speculative_proposed"] > 0, stats
        if name == "same":
            assert stats["speculative_accepted"] > 0.9 * stats["speculative_proposed"], stats


def test_draft_model_seeded_sampling_keeps_the_distribution(model_and_tokenizer, drafts, plain_seeded):
    model, tok = model_and_tokenizer
    spec, engine = run(model, tok, "draft", SEEDED, [CODE[2]] * len(SEEDED), draft=drafts["same"],
                       speculative_tokens=3, draft_model="unused")
    assert engine.stats()["speculative_accepted"] > 0
    assert spec != plain_seeded
    assert_same_law(plain_seeded, spec)


def test_a_draft_model_with_another_vocabulary_is_refused(model_and_tokenizer, drafts, tmp_path):
    """`stalwart serve` refuses a draft of another vocabulary size in one line (exit 2) before loading
    anything; a draft whose tokenizer differs at the same size is refused when it is loaded."""
    model, tok = model_and_tokenizer
    (tmp_path / "tok.json").write_text(tok.to_str())
    texts = [p.read_text() for p in sorted((Path(sysconfig.get_paths()["stdlib"]) / "email").glob("*.py"))]
    other = train_bpe(texts, ARGS.vocab_size)
    (tmp_path / "other.json").write_text(other.to_str())
    wide = TransformerArgs(**{**DRAFT_ARGS.__dict__, "vocab_size": ARGS.vocab_size + 64})
    for name, args, tok_file in (("target", ARGS, "tok.json"), ("wide", wide, "other.json"),
                                 ("other", DRAFT_ARGS, "other.json")):
        export_hf(new_model(args).state_dict(), args, tmp_path / tok_file, "<|endoftext|>", eos_id(tok), tmp_path / name)
    r = subprocess.run([sys.executable, "-m", "stalwart", "serve", "--hf", str(tmp_path / "target"),
                        "--port", "0", "--engine.speculative", "draft", "--engine.draft_model", str(tmp_path / "wide")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "vocabulary has 448 entries" in r.stderr, r.stderr
    for engine in (EngineConfig(speculative="draft"), EngineConfig(draft_model=str(tmp_path / "target"))):
        with pytest.raises(UserError, match="go together"):
            ServeConfig(engine=engine)
    with pytest.raises(UserError, match="tokenizer differs"):
        load_draft_model(str(tmp_path / "other"), ARGS.vocab_size, tok, torch.float32, torch.device("cpu"))
    same = load_draft_model(str(tmp_path / "target"), ARGS.vocab_size, tok, torch.float32, torch.device("cpu"))
    assert (same.args.vocab_size, same.args.dim) == (ARGS.vocab_size, ARGS.dim)
