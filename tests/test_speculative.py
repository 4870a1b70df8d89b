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
from stalwart.generate import TokenDraws
from stalwart.infer import speculative
from stalwart.infer.speculative import Drafts, DraftModelProposer, DraftSampling, load_draft_model, propose_ngram, verify
from stalwart.infer.structured import Constraint
from stalwart.models.flavors import TransformerArgs
from stalwart.models.llama import Transformer
from stalwart.train.init import materialize_and_init

pytestmark = pytest.mark.unit

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=384, ffn_hidden=128,
                       max_seq_len=256, init_std=0.4)
P_MIN = 1e-3  # a chi-square p-value below this fails (the draws are seeded: a pass is repeatable)


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor, groups: int = 1) -> float:
    """P-value of Pearson's chi-square test of counts ``observed`` against ``expected`` (``groups``
    multinomials laid end to end, each with the same total in both)."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token the target gives no probability was drawn"
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - groups
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


V = 8  # the verification tests' vocabulary


def speculate_once(target: torch.Tensor, draft: torch.Tensor, params: SamplingParams, draws: TokenDraws, last: int,
                   fed: int, point: bool) -> list[int]:
    """One step over a Markov chain: the target's logits for the token after ``prev`` are ``target[prev]``,
    the draft's ``draft[prev]``. The draft guesses ``fed`` + 1 tokens after ``last`` (sampled from its
    filtered distribution with the position's draft draws, or, ``point``, its most likely: a point mass)
    and the first ``fed`` join the rows; ``verify`` decides."""
    guesses, qs, prev = [], [], last
    for j in range(fed + 1):
        q = torch.softmax(filter_logits(draft[prev], params.temperature, params.top_k, params.top_p), -1)
        d = int(draft[prev].argmax()) if point else int(torch.multinomial(q, 1, generator=draws.at(j, 1)))
        guesses.append(d)
        qs.append(q)
        prev = d
    rows = torch.stack([target[last]] + [target[d] for d in guesses[:fed]])
    return verify(rows, Drafts(guesses[:fed], guesses[fed], None if point else qs), params, draws, 0)


def verification_p_values(params: SamplingParams, point: bool, trials: int = 2000) -> list[float]:
    """Chi-square p-values of the first token against the target's law and of the second (when the first
    was a kept draft) against the target's law after the first."""
    g = torch.Generator().manual_seed(0)
    target = torch.randn(V, V, generator=g) * 1.5
    draft = target + torch.randn(V, V, generator=g)  # a draft is an approximation of the target
    law = torch.stack([torch.softmax(filter_logits(r, params.temperature, params.top_k, params.top_p), -1)
                       for r in target])
    first, pairs = torch.zeros(V), torch.zeros(V, V)
    for t in range(trials):
        out = speculate_once(target, draft, params, TokenDraws(t), 3, 2, point)
        first[out[0]] += 1
        if len(out) > 1:
            pairs[out[0], out[1]] += 1
    seen = pairs.sum(1)
    busy = seen >= 50  # the first tokens kept often enough to test what follows them
    assert busy.any()
    return [chi_square_p(first, law[3] * trials),
            chi_square_p(pairs[busy].flatten(), (law[busy] * seen[busy, None]).flatten(), groups=int(busy.sum()))]


SETTINGS = [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)]


@pytest.mark.parametrize("point", [False, True], ids=["sampled_draft", "point_mass"])
@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_verify_keeps_the_target_distribution(temperature, top_k, top_p, point):
    """Standard speculative sampling over a Markov chain, two drafts fed and a third checked against the
    last row: the first token is distributed as the target's row, and the second (after the first was a
    kept draft) as the target's row after it, whatever the draft's distribution or point masses."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for p in verification_p_values(params, point):
        assert p > P_MIN, p


@pytest.mark.parametrize("point", [False, True], ids=["sampled_draft", "point_mass"])
def test_a_biased_verification_fails_the_test(monkeypatch, point):
    """The test has power: a rejection that draws from p instead of max(0, p - q) over-weights the drafts'
    tokens, and the same chi-square test rejects it."""
    monkeypatch.setattr(speculative, "residual", lambda p, q: p.clone())
    assert min(verification_p_values(SamplingParams(temperature=1.0), point)) < P_MIN


def test_verification_is_a_function_of_the_position():
    """A seeded verification is reproducible, and the token at a position does not depend on the draws of
    the positions before it (counter-based draws)."""
    g = torch.Generator().manual_seed(1)
    target, draft = torch.randn(V, V, generator=g), torch.randn(V, V, generator=g)
    params = SamplingParams(temperature=1.0)
    runs = [speculate_once(target, draft, params, TokenDraws(s), 3, 2, False) for s in range(50)]
    assert runs == [speculate_once(target, draft, params, TokenDraws(s), 3, 2, False) for s in range(50)]
    assert len({tuple(r) for r in runs}) > 10
    draws = TokenDraws(9)
    alone = int(torch.multinomial(torch.softmax(target[0], -1), 1, generator=draws.at(5)))
    torch.rand(100, generator=draws.at(4))  # another position's draws in between
    assert int(torch.multinomial(torch.softmax(target[0], -1), 1, generator=draws.at(5))) == alone


def test_verify_greedy_keeps_agreeing_drafts():
    rows = torch.full((4, 6), -5.0)
    rows[0, 1] = rows[1, 3] = rows[2, 0] = rows[3, 4] = 5.0  # most likely: 1, 3, 0, 4
    greedy = SamplingParams(temperature=0.0)
    assert verify(rows, Drafts([1, 3, 0]), greedy, None, 0) == [1, 3, 0, 4]
    assert verify(rows, Drafts([1, 2, 0]), greedy, None, 0) == [1, 3]
    assert verify(rows, Drafts([5, 3, 0]), greedy, None, 0) == [1]


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


def test_draft_model_proposer_extends_each_window(drafts):
    """Each sequence's drafts are the draft model's continuation of its latest ``window`` tokens, the
    window sliding over the drafts, however many sequences share the pass, and never more than its room:
    greedy, the most likely token; sampled, a draw from the filtered draft distribution (returned as q)
    with the position's draft draws."""
    draft = drafts["small"]
    proposer = DraftModelProposer(draft, window=5)
    contexts = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2, 8, 1], [6, 6], [9], [1, 2, 3, 4, 5, 6]]
    rooms = [3, 2, 4, 0, 3]
    params = SamplingParams(temperature=0.9, top_k=20)
    samplings = [None, DraftSampling(params, TokenDraws(4), 7), None, None, DraftSampling(params, TokenDraws(5), 2)]
    with torch.inference_mode():
        got = proposer(contexts, rooms, samplings)
        for c, r, s, g in zip(contexts, rooms, samplings, got):
            x, qs = list(c), []
            for j in range(r):
                logits = draft(torch.tensor([x[-5:]]))[0, -1]
                if s is None:
                    x.append(int(logits.argmax()))
                else:
                    qs.append(torch.softmax(filter_logits(logits, 0.9, 20), -1))
                    x.append(int(torch.multinomial(qs[-1], 1, generator=s.draws.at(s.start + j, 1))))
            assert g.fed == x[len(c):], (c, r, g)
            assert (g.q is None) == (s is None) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g.q or [], qs))


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


def resumed(model, tok, prompt: str, params: SamplingParams, emitted: list[int], draft=None, **cfg) -> list[int]:
    """What an engine emits for a request resumed after ``emitted`` (as the router's resume does)."""
    engine = Engine(model, tok, eos_id(tok), EngineConfig(kv_cache_mb=8, **cfg), draft=draft)
    engine.add("r", tok.encode(prompt).ids, params, emitted=emitted)
    out = []
    while engine.has_work():
        out += [c.token for o in engine.step() for c in o.choices]
    return out


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_seeded_speculation_emits_the_same_tokens_however_its_steps_fall(model_and_tokenizer, drafts, kind):
    """A seeded request's tokens with speculation depend on its seed and the tokens before each, not on
    where steps begin: the same with 2 or 4 drafts a step, batched or alone, and when resumed from any
    point of its output (as the router resumes it on another replica)."""
    model, tok = model_and_tokenizer
    prompts = [CODE[0], CODE[2]]
    params = [SamplingParams(max_tokens=20, temperature=t, top_k=k, seed=s, ignore_eos=True)
              for s, (t, k) in enumerate([(0.8, 0), (1.0, 8)])]
    cfg = dict(draft=drafts["same"], draft_model="unused", draft_window=16) if kind == "draft" else {}
    first, engine = run(model, tok, kind, params, prompts, speculative_tokens=4, **cfg)
    assert engine.stats()["speculative_accepted"] > 0
    assert run(model, tok, kind, params, prompts, together=False, speculative_tokens=2, **cfg)[0] == first
    for i in (0, 1):
        for cut in (1, 11):
            rest = resumed(model, tok, prompts[i], params[i], first[i][:cut], speculative=kind, speculative_tokens=3,
                           **cfg)
            assert rest == first[i][cut:], (i, cut)
