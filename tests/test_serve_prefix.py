"""Cache-aware routing as pure logic (serve/prefix.py): the digests the router computes are the engine's
own, the longest held prefix wins until the load is unbalanced, reports replace what the router assumed,
and the other two policies; the hand-off's keys and values (infer/handoff.py) continue a request on
another engine with the bits and tokens it has on one."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from stalwart.config.serve import EngineConfig
from stalwart.infer.blocks import BlockPool
from stalwart.infer.engine import Engine
from stalwart.infer.sampling import SamplingParams
from stalwart.serve.disagg import Roles, read_kv
from stalwart.serve.prefix import SENT_TTL_S, Policy, prompt_digests

from test_infer_engine import ByteTokenizer, build, prompts

pytestmark = pytest.mark.unit


def test_the_router_hashes_prompts_as_the_engine_registers_them():
    pool = BlockPool(16, 4)
    tokens = list(range(11))
    blocks = pool.allocate(3)
    digests = prompt_digests(tokens, 4)
    for b, d in zip(blocks, digests):
        pool.register(b, d)
    assert len(digests) == 2  # full blocks only
    assert pool.match_prefix(tokens, 8)[0] == blocks[:2]


def test_cache_aware_takes_the_longest_held_prefix_until_the_load_is_unbalanced():
    p = Policy("cache-aware", 3, balance_abs=2, balance_rel=1.5)
    a, b = prompt_digests(list(range(64)), 16), prompt_digests(list(range(100, 164)), 16)
    usable = [True] * 3
    assert p.order([0, 0, 0], usable, a)[0] == 0  # nothing held: least loaded, lowest index
    p.chose(0, a)
    assert p.order([1, 0, 0], usable, a)[0] == 0  # held there: sticks though busier
    assert p.order([1, 0, 0], usable, b)[0] == 1  # another prefix: least loaded
    p.chose(1, b)
    p.view.routed(2, a[:2], now=0.0)  # a shorter prefix of a elsewhere
    assert p.order([2, 1, 0], usable, a) == [0, 2, 1]
    assert p.order([4, 1, 0], usable, a)[0] == 2  # 4 - 0 > 2 and 4 > 1.5 x 0: the least loaded
    assert p.order([1, 0, 0], [False, True, True], a)[:2] == [2, 1]  # not usable: last
    assert p.stats()["prefix_hits"] == 0 and p.stats()["prompt_blocks"] == 8


def test_a_report_replaces_what_was_held_and_old_sends_expire():
    p = Policy("cache-aware", 2, 8, 1.5)
    a = prompt_digests(list(range(48)), 16)
    p.view.routed(0, a, now=100.0)
    assert p.view.matched(0, a) == 3
    p.view.reported(0, set(a[:1]), now=100.0 + SENT_TTL_S / 2)  # not computed yet: still counted as held
    assert p.view.matched(0, a) == 3
    p.view.reported(0, set(a[:1]), now=101.0 + SENT_TTL_S)  # evicted since
    assert p.view.matched(0, a) == 1
    p.view.forget(0)  # started again: an empty cache
    assert p.view.matched(0, a) == 0


def test_least_load_and_round_robin():
    ll, rr = Policy("least-load", 3, 0, 1.0), Policy("round-robin", 3, 0, 1.0)
    a = prompt_digests(list(range(32)), 16)
    ll.chose(2, a)
    assert ll.order([2, 1, 3], [True] * 3, a) == [1, 0, 2]
    assert [rr.order([5, 0, 0], [True, True, False], a)[0] for _ in range(4)] == [0, 1, 0, 1]
    assert Policy("cache-aware", 4, 0, 1.0).order([0] * 4, [True] * 4, None, among=[2, 3]) == [2, 3]
    with pytest.raises(ValueError, match="round-robin"):
        Policy("random", 2, 0, 1.0)


def test_roles():
    r = Roles(4, 1)
    assert r.first(True) == ([0], [1, 2, 3]) and r.first(False) == ([1, 2, 3], [0])
    assert [r.name(i) for i in range(4)] == ["prefill", "decode", "decode", "decode"]
    assert Roles(2).first(True) == ([0, 1], []) and Roles(2).name(0) == "both"


def test_a_kv_name_that_is_not_ours_is_never_read(tmp_path, monkeypatch):
    monkeypatch.setenv("STALWART_KV_DIR", str(tmp_path))
    (tmp_path / "secret").write_text("x")
    assert read_kv("../secret") is None and read_kv("secret") is None and read_kv(7) is None
    assert (tmp_path / "secret").exists()
    assert read_kv("0" * 32 + ".kv") is None  # ours in form, absent: recomputed


def test_a_handed_off_request_goes_on_with_the_bits_of_one_engine():
    """Prefill on one engine (first token, then hand-off), decode on another from the keys and values:
    the tokens and log-probabilities are those of one engine doing both, and the second computed no prompt."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    model = build()
    # The first engine computes every prompt afresh (the hand-off run would otherwise map the whole run's blocks).
    one, two = (Engine(m, ByteTokenizer(), None, EngineConfig(block_size=4, prefix_caching=c))
                for m, c in ((copy.deepcopy(model), False), (model, True)))
    for prompt in prompts(4)[1:4]:
        def run(engine, rid, **kw):
            engine.add(rid, prompt, dataclasses.replace(params), **kw)
            outs = []
            while engine.has_work():
                outs += engine.step()
            return outs

        whole = run(one, "whole")
        first = run(one, "p", handoff=True)
        assert len(first) == 1 and first[0].finish_reason == "handoff" and first[0].kv.shape[2] == len(prompt)
        rest = run(two, "d", emitted=[first[0].choices[0].token], kv=first[0].kv)
        got = first[0].choices + [c for o in rest for c in o.choices]
        assert [(c.token, c.logprob) for c in got] == [(c.token, c.logprob) for o in whole for c in o.choices]
    assert two.handoff_tokens["imported"] == sum(map(len, prompts(4)[1:4]))
    assert two.scheduler.cached_tokens_total == 0 and torch.is_tensor(first[0].kv)
