"""The inference engine's tensor-parallel split (``parallel/tensor.py`` in its replicated-stream form, each
planned module a ``LocalShard``) computes what one process computes: 2 gloo ranks, a vocabulary that does
not divide the degree (uneven embedding and head shards), tied and untied heads."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import spawn_gloo

pytestmark = pytest.mark.multiproc


def run_split(case: dict, rank: int, world: int) -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    from stalwart.infer.load import copy_full_state, layout_model
    from stalwart.models.flavors import FLAVORS
    from stalwart.models.llama import Transformer
    from stalwart.parallel.tensor import LocalShard
    from stalwart.runtime.group import device_mesh

    cpu = torch.device("cpu")
    args = dataclasses.replace(FLAVORS["debug"], vocab_size=383, tie_embeddings=case["tied"])
    torch.manual_seed(0)  # the same full weights and tokens on every rank
    full = Transformer(args).eval()
    tokens = torch.randint(0, args.vocab_size, (1, 21))
    split = layout_model(args, cpu, device_mesh(cpu, (world,), ("tp",))).eval()
    copy_full_state(split, full.state_dict())
    with torch.no_grad():
        want, got = full(tokens), split(tokens)
    return {"max_diff": (want - got).abs().max().item(), "argmax_equal": bool(torch.equal(want.argmax(-1), got.argmax(-1))),
            "local": type(split.output) is LocalShard and type(split.layers["0"].attention.wo) is LocalShard,
            "dtensor": isinstance(split.tok_embeddings.weight, DTensor),
            "tied": split.output.weight is split.tok_embeddings.weight,
            "vocab_rows": split.tok_embeddings.rows}


def test_split_forward_equals_one_process(tmp_path):
    for case, ranks in zip([{"tied": False}, {"tied": True}], spawn_gloo(tmp_path, 2, run_split, [{"tied": False}, {"tied": True}])):
        for r in ranks:
            assert r["max_diff"] < 1e-4 and r["argmax_equal"] and r["local"] and r["dtensor"], (case, r)
            assert r["tied"] == case["tied"], (case, r)
        assert [r["vocab_rows"] for r in ranks] == [192, 191]
