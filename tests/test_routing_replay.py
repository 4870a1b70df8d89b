"""Routing replay: a forward handed recorded experts uses exactly those, even where its own top-k would
pick others (a perturbed router), with the gate's gradient intact; the engine records every fed
position's experts (a reused prefix included); records survive packing and the JSON of the RL state."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from stalwart.config.serve import EngineConfig
from stalwart.infer.engine import Engine
from stalwart.infer.sampling import SamplingParams
from stalwart.models.flavors import MoEArgs, TransformerArgs
from stalwart.models.llama import Transformer
from stalwart.models.moe import MoE, Routing
from stalwart.rl import rollout, routing
from stalwart.rl.state import group_of, group_record
from stalwart.rl.tasks import split
from stalwart.train.init import materialize_and_init

pytestmark = pytest.mark.unit

MOE = MoEArgs(n_experts=8, top_k=2, hidden=24, route_norm=True)


def _moe() -> MoE:
    torch.manual_seed(0)
    m = MoE(16, MOE, None)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    m.reset_buffers()
    return m


def _flip_one(m: MoE, x: torch.Tensor) -> int:
    """Nudge the gate so one token's third choice overtakes its second (its top-2 flips); that token."""
    flat = x.reshape(-1, 16)
    with torch.no_grad():
        logits = m.router.gate(flat)
    top = logits.softmax(-1).topk(3, -1)
    t = int((top.values[:, 1] - top.values[:, 2]).argmin())
    second, third = int(top.indices[t, 1]), int(top.indices[t, 2])
    logits = logits[t]
    gap = float(logits[second] - logits[third])
    with torch.no_grad():  # raise the third expert's logit for token t by just past the gap
        m.router.gate.weight[third] += (gap + 1e-3) * flat[t] / flat[t].dot(flat[t])
    return t


def test_replayed_routing_is_exactly_the_recorded_one_where_recomputed_routing_flips():
    m = _moe()
    x = torch.randn(1, 12, 16)
    rec = Routing(record=True)
    before = m(x, routing=rec)
    recorded = rec.stacked()  # (tokens, 1 sparse layer, k)
    assert recorded.shape == (12, 1, 2)
    assert torch.equal(before, m(x)), "recording changes nothing"
    t = _flip_one(m, x)

    own = Routing(record=True)
    recomputed = m(x, routing=own)
    flipped = (own.stacked().sort(-1).values != recorded.sort(-1).values).any(-1).flatten()
    assert flipped[t] and int(flipped.sum()) >= 1  # the perturbed router routes token t elsewhere

    replay = Routing(replay=recorded.view(1, 12, 1, 2).to(torch.int8), record=True)
    y = m(x, routing=replay)
    assert torch.equal(replay.stacked(), recorded)  # the experts used are the recorded ones, in order
    assert int(replay.replayed) == 12 and int(replay.differed) == int(flipped.sum()) and replay.layers == 1
    assert not torch.allclose(y[0, t], recomputed[0, t])  # the flipped token's output differs
    same = ~flipped  # the same experts (perhaps summed in another order, in other expert batches): rounding
    torch.testing.assert_close(y[0, same], recomputed[0, same], rtol=0, atol=1e-6)

    # The flipped token's output is the recorded experts weighted by the perturbed gate's probabilities
    # (renormalised over them): the router still takes part.
    flat = x.reshape(-1, 16)[t]
    e = recorded[t, 0]
    p = m.router.gate(flat).softmax(-1)[e]
    w = p / p.sum()
    ex = m.experts
    outs = [(torch.nn.functional.silu(flat @ ex.w1[i]) * (flat @ ex.w3[i])) @ ex.w2[i] for i in e.tolist()]
    torch.testing.assert_close(y[0, t], w[0] * outs[0] + w[1] * outs[1], rtol=1e-5, atol=1e-6)

    y.square().sum().backward()  # the gate gets a gradient under replay
    assert m.router.gate.weight.grad is not None and m.router.gate.weight.grad.abs().sum() > 0


def test_padding_positions_route_as_usual():
    m = _moe()
    x = torch.randn(1, 6, 16)
    own = Routing(record=True)
    y_own = m(x, routing=own)
    replay = torch.full((1, 6, 1, 2), -1, dtype=torch.int8)
    replay[0, :3, 0] = own.stacked()[:3, 0].to(torch.int8)
    r = Routing(replay=replay)
    assert torch.equal(m(x, routing=r), y_own)
    assert int(r.replayed) == 3 and int(r.differed) == 0


ARGS = TransformerArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64, max_seq_len=64,
                       init_std=0.3, moe=MoEArgs(n_experts=8, top_k=2, hidden=32, n_dense_layers=1))


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i) for i in ids)


def test_engine_records_the_experts_of_every_fed_position_and_a_replaying_forward_uses_them():
    def build() -> Transformer:
        with torch.device("meta"):
            m = Transformer(ARGS)
        materialize_and_init(m, torch.device("cpu"), 0)
        return m.eval()

    model = build()  # the trainer's plain forward; the engine swaps its copy's attention for the paged one
    engine = Engine(build(), _Tok(), None, EngineConfig(block_size=4, pad_rows=1), record_routing=True)
    prompt = list(range(3, 13))  # 10 tokens: two full blocks a second request reuses from the cache
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=0, ignore_eos=True)
    outs: dict[str, list] = {}
    for rid in ("a", "b"):  # one after the other: b maps a's cached prompt blocks
        engine.add(rid, prompt, dataclasses.replace(params, seed=len(outs)))
        while engine.has_work():
            for o in engine.step():
                outs.setdefault(o.rid, []).extend(o.choices)
    assert engine.scheduler.cached_tokens_total > 0
    for rid, choices in outs.items():
        rec = engine.routed[rid]
        seq = prompt + [c.token for c in choices]
        assert rec.shape == (len(seq) - 1, 2, 2) and rec.dtype == torch.int8  # 2 sparse layers of 3
        replay = Routing(replay=rec.unsqueeze(0), record=True)
        with torch.no_grad():
            logits = model(torch.tensor([seq[:-1]]), routing=replay)
        assert int(replay.replayed) == 2 * (len(seq) - 1) and replay.layers == 2
        assert int(replay.differed) == 0  # the plain forward's own top-k agrees with the engine's record
        logp = torch.log_softmax(logits[0].float(), -1)
        got = [float(logp[len(prompt) - 1 + i, c.token]) for i, c in enumerate(choices)]
        np.testing.assert_allclose(got, [c.logprob for c in choices], atol=1e-4)
    # The reused prompt positions carry the experts that computed them.
    assert torch.equal(engine.routed["a"][:8], engine.routed["b"][:8])


def test_records_pack_into_rows_and_survive_json():
    a = np.array([[[1, 2]], [[3, 4]]], dtype=np.int8)  # 2 positions, 1 layer, k = 2
    b = np.array([[[5, 6]]], dtype=np.int8)
    packed = routing.pack([a, b], 4)
    assert packed.shape == (2, 4, 1, 2) and packed.dtype == np.int8
    assert packed[0, :2].tolist() == a.tolist() and (packed[0, 2:] == -1).all() and (packed[1, 1:] == -1).all()
    wide = np.array([[[200, 3]]], dtype=np.int16)
    back = routing.from_json(routing.to_json([a, wide]))
    assert [x.dtype for x in back] == [np.int8, np.int16] and back[0].tolist() == a.tolist()
    assert back[1].tolist() == wide.tolist() and routing.from_json(routing.to_json(None)) is None
    with pytest.raises(ValueError, match="row length"):
        routing.pack([a], 1)


def test_a_pending_group_keeps_its_records_through_the_rl_state_file():
    train, _ = split(0, 0.2)
    (req,) = rollout.plan_step(3, 0, train, 1, 2)
    recs = [np.arange(12, dtype=np.int8).reshape(3, 2, 2), np.array([[[7, 1]]] * 2, dtype=np.int8).reshape(2, 1, 2)]
    g = rollout.Group(req, [1, 2], [[4, 5], [6]], [[-0.5, -0.25], [-2.0]], 2, routing=recs)
    back = group_of(json.loads(json.dumps(group_record(g))), {i.key: i for i in train})
    assert [r.dtype for r in back.routing] == [np.int8, np.int8]
    assert [r.tolist() for r in back.routing] == [r.tolist() for r in recs] and back.responses == g.responses
