"""Hugging Face Mixtral export/import of a mixture-of-experts model: logits match transformers'
MixtralForCausalLM, the round trip is exact, and shapes Mixtral cannot express are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stalwart.errors import UserError
from stalwart.export.hf import export_hf, from_hf_state, load_hf_into, read_hf
from stalwart.export.hf_moe import MoEExportError
from stalwart.models.flavors import MoEArgs, TransformerArgs
from stalwart.models.llama import Transformer
from stalwart.train.init import materialize_and_init
from test_export_hf import _tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.unit

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=96, max_seq_len=32,
                       moe=MoEArgs(n_experts=4, top_k=2, hidden=48))


def build(args: TransformerArgs, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    materialize_and_init(model, torch.device("cpu"), seed)
    for p in model.parameters():  # a router that really discriminates (init std 0.02 routes near-uniformly)
        p.data.mul_(5.0 if p.ndim == 2 and p.shape[0] == 4 else 1.0)
    return model.eval()


def test_mixtral_export_matches_transformers_and_round_trips(tmp_path):
    model = build(ARGS)
    state = dict(model.state_dict())
    out = tmp_path / "hf"
    export_hf(state, ARGS, _tokenizer(tmp_path), "<|endoftext|>", 0, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    tokens = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    config, tensors = read_hf(out)
    back = from_hf_state(config, tensors, ARGS)
    for k, v in state.items():
        if "expert_bias" not in k:
            assert torch.equal(back[k], v), k
    # transformers' own (fused) layout imports too.
    fused = {k: v.detach() for k, v in hf.state_dict().items()}
    fresh = build(ARGS, seed=7)
    load_hf_into(fresh, ARGS, out)
    with torch.no_grad():
        assert torch.equal(fresh(tokens), ours)
    again = from_hf_state(config, fused, ARGS)
    assert all(torch.equal(again[k], back[k]) for k in back)


def test_shapes_mixtral_cannot_express_are_refused(tmp_path):
    for moe in (dataclasses.replace(ARGS.moe, n_shared=1), dataclasses.replace(ARGS.moe, n_dense_layers=1),
                dataclasses.replace(ARGS.moe, score_func="sigmoid")):
        args = dataclasses.replace(ARGS, moe=moe)
        with pytest.raises(UserError, match="Mixtral"):
            export_hf(build(args).state_dict(), args, _tokenizer(tmp_path), "<|endoftext|>", 0, tmp_path / "x")
    model = build(ARGS)
    model.layers["1"].moe.router.expert_bias[2] = 0.1  # trained with bias balancing
    with pytest.raises(MoEExportError, match="balancing bias"):
        export_hf(model.state_dict(), ARGS, _tokenizer(tmp_path), "<|endoftext|>", 0, tmp_path / "y")
