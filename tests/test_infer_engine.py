"""The inference engine in process: greedy tokens equal `generate`'s whatever the batch, the chunking or
the cache pressure; log-probabilities equal the training forward; continuous batching, prefix reuse,
stop strings, and weight updates that drop nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stalwart.config.serve import EngineConfig
from stalwart.errors import UserError
from plain_generate import sample
from stalwart.infer.blocks import BlockPool
from stalwart.infer.engine import Engine
from stalwart.infer.outputs import RequestError
from stalwart.infer.sampling import SamplingError, SamplingParams
from stalwart.infer.scheduler import Scheduler, Sequence
from stalwart.infer.text import TextTail
from stalwart.models.flavors import TransformerArgs
from stalwart.models.llama import Transformer
from stalwart.train.init import materialize_and_init

# A large init spreads the logits, so greedy choices are far from ties and sequences do not collapse.
ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_hidden=128, max_seq_len=128,
                       init_std=0.4)


class ByteTokenizer:
    """Token i is the character chr(32 + i); enough for stop strings and text deltas."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i) for i in ids)


def build(seed: int = 0, args: TransformerArgs = ARGS) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    materialize_and_init(model, torch.device("cpu"), seed)
    return model.eval()


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = [1, 3, 17, 40, 5, 60, 2, 33, 9, 70, 16, 25]
    return [torch.randint(0, ARGS.vocab_size, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def run(engine: Engine, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, p in enumerate(batch):
        engine.add(str(i), p, dataclasses.replace(params))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.rid, []).extend(c.token for c in o.choices)
    return [out[str(i)] for i in range(len(batch))]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CONFIGS = {
    "default": EngineConfig(),
    # Small budget (prompts prefilled in chunks), small blocks, and a cache too small for 32 at once
    # (sequences are preempted and recomputed).
    "chunked+preempted": EngineConfig(block_size=4, max_batch_tokens=24, max_seqs=8, kv_cache_mb=0.05),
}


@pytest.mark.unit
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_tokens_equal_generate_for_any_batch(config):
    model = build()
    reference = [sample(build(), p, GREEDY.max_tokens, ARGS.max_seq_len, temperature=0) for p in prompts(32)]
    assert len({tuple(r) for r in reference}) > 20  # a meaningful comparison: outputs differ
    for batch_size in (1, 4, 32):
        got = []
        engine = Engine(model, ByteTokenizer(), None, CONFIGS[config])
        for s in range(0, 32, batch_size):
            got += run(engine, prompts(32)[s:s + batch_size], GREEDY)
        assert got == reference, f"batch {batch_size}"
    if config != "default":
        assert engine.scheduler.preempted_total > 0


@pytest.mark.unit
def test_one_sampler_the_engine_and_generate_draw_the_same_tokens_from_a_seed():
    """Temperature and top-k sampling: a request with seed s draws what `stalwart generate --seed s` draws
    (one sampler, one host generator per sequence), alone or batched."""
    model = build()
    batch = prompts(6)
    reference = [sample(build(), p, 12, ARGS.max_seq_len, temperature=0.8, top_k=40, seed=s)
                 for s, p in enumerate(batch)]
    assert len({tuple(r) for r in reference}) == 6
    engine = Engine(model, ByteTokenizer(), None, EngineConfig())
    for s, p in enumerate(batch):
        engine.add(str(s), p, SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=s, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.rid, []).extend(c.token for c in o.choices)
    assert [out[str(s)] for s in range(6)] == reference


def logprobs(engine: Engine, batch: list[list[int]]) -> list[list[float]]:
    for i, p in enumerate(batch):
        engine.add(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True))
    out: dict[str, list[float]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.rid, []).extend(c.logprob for c in o.choices)
    return [out[str(i)] for i in range(len(batch))]


@pytest.mark.unit
@pytest.mark.parametrize("budget", [512, 24])
def test_batch_composition_does_not_change_a_single_bit(budget):
    """Alone or among 31 others, prefilled whole or in chunks: the same log-probabilities, bit for bit."""
    model = build()
    cfg = EngineConfig(max_batch_tokens=budget, max_seqs=32, pad_rows=8)
    alone = [logprobs(Engine(model, ByteTokenizer(), None, cfg), [p])[0] for p in prompts(32)]
    assert logprobs(Engine(model, ByteTokenizer(), None, cfg), prompts(32)) == alone


@pytest.mark.unit
def test_logprobs_equal_the_training_forward():
    args = dataclasses.replace(ARGS, init_std=0.02)  # logits of a usual scale: the bound is absolute
    model = build(args=args)
    prompt = prompts(4)[3]
    engine = Engine(model, ByteTokenizer(), None, EngineConfig(block_size=8, max_batch_tokens=16))
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7, logprobs=3, ignore_eos=True)
    engine.add("r", prompt, params)
    choices = []
    while engine.has_work():
        choices += [c for o in engine.step() for c in o.choices]
    tokens = prompt + [c.token for c in choices]
    with torch.no_grad():
        logp = torch.log_softmax(build(args=args)(torch.tensor([tokens])).float(), -1)[0]
    for k, c in enumerate(choices):
        row = logp[len(prompt) - 1 + k]
        assert abs(c.logprob - float(row[c.token])) < 1e-6
        assert [t for t, _ in c.top] == torch.topk(row, 3).indices.tolist()


@pytest.mark.unit
def test_a_request_joins_a_running_batch_and_is_unaffected():
    model = build()
    alone = run(Engine(model, ByteTokenizer(), None, EngineConfig()), prompts(2), GREEDY)
    engine = Engine(model, ByteTokenizer(), None, EngineConfig())
    engine.add("0", prompts(2)[0], dataclasses.replace(GREEDY))
    out: dict[str, list[int]] = {}
    for _ in range(4):
        for o in engine.step():
            out.setdefault(o.rid, []).extend(c.token for c in o.choices)
    engine.add("1", prompts(2)[1], dataclasses.replace(GREEDY))
    before = len(out["0"])
    step = engine.step()  # one forward: request 0's next decode and request 1's whole prefill
    assert {o.rid for o in step} == {"0", "1"} and len(out["0"]) == before
    for o in step:
        out.setdefault(o.rid, []).extend(c.token for c in o.choices)
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.rid, []).extend(c.token for c in o.choices)
    assert [out["0"], out["1"]] == alone


@pytest.mark.unit
def test_shared_prefix_is_computed_once():
    model = build()
    base = prompts(4)[3][:40]
    batch = [base + [1, 2, 3], base + [4, 5], base + [6]]
    plain = run(Engine(model, ByteTokenizer(), None, EngineConfig(prefix_caching=False)), batch, GREEDY)
    engine = Engine(model, ByteTokenizer(), None, EngineConfig(block_size=8))
    got = [run(engine, [p], GREEDY)[0] for p in batch]
    assert got == plain
    assert engine.scheduler.cached_tokens_total == 2 * 40  # five full blocks of 8, reused twice


@pytest.mark.unit
def test_stop_strings_are_never_shown_in_part():
    tail = TextTail(ByteTokenizer(), ["XYZ"])
    ids = [ord(c) - 32 for c in "abcXYq1XYZrest"]
    shown, hit = "", False
    for n in range(1, len(ids) + 1):
        delta, hit = tail.push(ids[:n])
        shown += delta
        assert "abcXYq1".startswith(shown)  # "XY" is shown only once the "q" rules out "XYZ"
        if n == 5:
            assert shown == "abc"
        if hit:
            break
    assert hit and shown == "abcXYq1"


@pytest.mark.unit
def test_weight_update_between_steps_drops_nothing():
    model = build(seed=0)
    engine = Engine(model, ByteTokenizer(), None, EngineConfig())
    for i, p in enumerate(prompts(3)):
        engine.add(str(i), p, dataclasses.replace(GREEDY))
    finished, versions = {}, {}
    for k in range(200):
        if k == 5:
            engine.load_full_state(build(seed=1).state_dict(), version=1)
        for o in engine.step():
            versions.setdefault(o.rid, set()).add(o.weight_version)
            if o.finished:
                finished[o.rid] = o.finish_reason
        if not engine.has_work():
            break
    assert finished == {"0": "length", "1": "length", "2": "length"}
    assert all(v == {0, 1} for v in versions.values())
    # New requests see the new weights only (cached prefixes of the old weights were dropped).
    fresh = run(engine, prompts(1), GREEDY)
    assert fresh == [sample(build(seed=1), prompts(1)[0], GREEDY.max_tokens, ARGS.max_seq_len, temperature=0)]


@pytest.mark.unit
def test_requests_the_engine_cannot_take_are_refused_with_the_reason():
    engine = Engine(build(), ByteTokenizer(), None, EngineConfig())
    with pytest.raises(RequestError, match="exceeds the model's context of 128"):
        engine.add("a", [1] * 120, SamplingParams(max_tokens=20))
    with pytest.raises(RequestError, match="empty"):
        engine.add("b", [], SamplingParams())
    with pytest.raises(RequestError, match=r"token ids must be in \[0, 96\)"):
        engine.add("c", [500], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        engine.add("d", [1], SamplingParams(top_p=0.0))
    # A seed torch's generator cannot take: refused before anything enters the scheduler.
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(SamplingError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\]") as e:
            engine.add("e", [1], SamplingParams(seed=seed))
        assert e.value.param == "seed"
    assert not engine.has_work() and not engine.requests
    with pytest.raises(RequestError, match=r"max_tokens 8 at most") as e:
        engine.add("f", [1] * 120, SamplingParams(max_tokens=20))
    assert e.value.param == "max_tokens"
    # The extremes of the range are taken.
    engine.add("g", [1], SamplingParams(max_tokens=1, seed=2**64 - 1))
    engine.add("h", [1], SamplingParams(max_tokens=1, seed=-(2**63)))
    assert {o.rid for o in engine.step()} == {"g", "h"} and not engine.has_work()


@pytest.mark.unit
def test_a_weight_update_that_fails_its_check_changes_nothing():
    engine = Engine(build(seed=0), ByteTokenizer(), None, EngineConfig())
    before = run(engine, prompts(2), GREEDY)
    state = build(seed=1).state_dict()
    del state["norm.weight"]
    with pytest.raises(UserError, match="no tensor 'norm.weight'"):
        engine.update_weights(lambda: state, 1)
    assert engine.weight_version == 0 and run(engine, prompts(2), GREEDY) == before
    engine.update_weights(lambda: build(seed=1).state_dict(), 1)
    assert engine.weight_version == 1 and run(engine, prompts(2), GREEDY) != before


@pytest.mark.unit
def test_scheduler_preempts_the_newest_and_resumes_it_from_its_cached_blocks():
    pool = BlockPool(num_blocks=6, block_size=4)
    sched = Scheduler(pool, max_batch_tokens=64, max_seqs=4)
    a, b = Sequence("a", list(range(10)), 10, 16), Sequence("b", list(range(50, 58)), 8, 16)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [(p.seq.rid, p.start, p.n) for p in first] == [("a", 0, 10), ("b", 0, 8)]  # 3 + 2 blocks
    for p in first:
        sched.commit(p)
    a.tokens += [11, 12, 13]  # a needs a 4th block, b a 3rd: only one is free
    b.tokens += [59]
    second = sched.schedule()
    assert [p.seq.rid for p in second] == ["a"] and sched.waiting[0] is b and b.preemptions == 1
    for p in second:
        sched.commit(p)
    sched.finish(a)
    third = sched.schedule()
    # b comes back: its two full blocks were still cached, so only the rest is recomputed.
    assert [(p.seq.rid, p.start, p.n) for p in third] == [("b", 8, 1)]


@pytest.mark.unit
def test_a_sparse_model_serves_with_the_same_greedy_tokens():
    from stalwart.models.flavors import FLAVORS

    args = dataclasses.replace(FLAVORS["debug-moe"], vocab_size=96, max_seq_len=128, init_std=0.4)
    reference = [sample(build(args=args), p, GREEDY.max_tokens, 128, temperature=0) for p in prompts(8)]
    assert run(Engine(build(args=args), ByteTokenizer(), None, EngineConfig()), prompts(8), GREEDY) == reference


@pytest.mark.unit
@pytest.mark.parametrize("lengths,mode", [("equal", "grouped"), ("unequal", "grouped"), ("unequal", "batched")])
def test_a_batch_admitted_together_decodes_from_one_view_of_the_cache(lengths, mode, monkeypatch):
    """Sequences admitted together are placed at evenly spaced blocks, so their decodes read the cache in
    place, in one strided call (lengths that differ are masked), in either decode mode (batched gathers
    only what one view cannot hold); the tokens are generate's."""
    import stalwart.infer.attention as attention

    g = torch.Generator().manual_seed(3)
    sizes = [20] * 8 if lengths == "equal" else [17, 20, 23, 26, 19, 22, 25, 18]
    batch = [torch.randint(0, ARGS.vocab_size, (n,), generator=g).tolist() for n in sizes]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)  # 2 blocks of 16 each
    reference = [sample(build(), p, 6, ARGS.max_seq_len, temperature=0) for p in batch]
    seen: list[attention.StepLayout] = []
    real = attention.build_layout
    monkeypatch.setattr(attention, "build_layout", lambda *a: seen.append(real(*a)) or seen[-1])
    monkeypatch.setattr("stalwart.infer.engine.build_layout", attention.build_layout)
    engine = Engine(build(), ByteTokenizer(), None, EngineConfig(decode_attention=mode))
    assert run(engine, batch, params) == reference
    decodes = [d for layout in seen for d in layout.decodes]
    assert decodes and all(d.count == 8 and d.stride == 32 for d in decodes)
    assert all((d.mask is None) == (lengths == "equal") for d in decodes)


@pytest.mark.unit
@pytest.mark.parametrize("window", [0, 8])
def test_batched_decodes_give_the_grouped_tokens(window, monkeypatch):
    """engine.decode_attention = batched (every decode in one call per layer over its gathered blocks, a
    GPU's default) against grouped (the CPU's): greedy tokens equal generate's, log-probabilities within
    float32 rounding, with and without a sliding window, whole and chunked (a small cache: preempted
    sequences resumed on scattered blocks)."""
    import stalwart.infer.attention as attention

    args = dataclasses.replace(ARGS, sliding_window=window)
    batch = prompts(16)
    reference = [sample(build(args=args), p, GREEDY.max_tokens, ARGS.max_seq_len, temperature=0) for p in batch]
    seen: list[tuple[str, attention.StepLayout]] = []  # (mode, layout)
    real = attention.build_layout
    monkeypatch.setattr("stalwart.infer.engine.build_layout", lambda *a: seen.append((a[3], real(*a))) or seen[-1][1])
    model = build(args=args)
    for base in (EngineConfig(), CONFIGS["chunked+preempted"]):
        got = {}
        for mode in ("grouped", "batched"):
            cfg = dataclasses.replace(base, decode_attention=mode)
            assert run(Engine(model, ByteTokenizer(), None, cfg), batch, GREEDY) == reference, mode
            got[mode] = logprobs(Engine(model, ByteTokenizer(), None, cfg), batch)
        diff = max(abs(a - b) for g, h in zip(got["grouped"], got["batched"]) for a, b in zip(g, h))
        assert diff < 1e-4, diff
    batched = [layout for mode, layout in seen if mode == "batched"]
    # One call per layer for every one-token piece: a strided view (or one sequence) if it holds them all,
    # else their blocks gathered (here: unequal prompts, so unevenly placed, then scattered by preemption).
    assert all(len(lo.decodes) + sum(s.q_len == 1 for s in lo.spans) <= 1 for lo in batched)
    assert max(d.count for lo in batched for d in lo.decodes if d.table is not None) == 16


@pytest.mark.unit
def test_the_pool_places_a_sequence_where_it_can_grow_in_place():
    pool = BlockPool(num_blocks=16, block_size=4)
    a = pool.allocate(2, room=5)  # a new sequence: two blocks now, room for five
    b = pool.allocate(1, room=3)
    assert a == [0, 1] and b == [5]
    assert pool.allocate(2, after=a[-1]) == [2, 3]  # grows in place
    pool.allocate(1, after=3)  # block 4, the last of a's room
    assert pool.allocate(1, after=4) == [8]  # 5 is b's: the next free run past everyone's room
