"""The record of the weights a replica applied (serve/applied.py), which a replica started again loads: a
disk update is recorded as the directory read, a live update as a Hugging Face snapshot that reads
back bit for bit, and only the newest snapshot is kept. The restarts themselves run through the CLI in
test_serve_e2e.py (a pipeline-parallel group) and test_serve_live_e2e.py (a live update, a router)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from stalwart.data.tokenizer import eos_id, train_bpe
from stalwart.infer.load import read_source
from stalwart.models.flavors import TransformerArgs
from stalwart.models.llama import Transformer
from stalwart.serve.applied import AppliedWeights
from stalwart.train.init import materialize_and_init

pytestmark = pytest.mark.unit

ARGS = TransformerArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=300, ffn_hidden=64, max_seq_len=64)


class Stub:  # what AppliedWeights.keep reads of an engine
    def __init__(self, tok) -> None:
        self.args, self.tokenizer, self.eos_id = ARGS, tok, eos_id(tok)


def test_updates_are_recorded_and_live_ones_snapshotted(tmp_path):
    texts = [p.read_text() for p in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))]
    tok = train_bpe(texts, ARGS.vocab_size)
    with torch.device("meta"):
        model = Transformer(ARGS)
    materialize_and_init(model, torch.device("cpu"), 0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    applied = AppliedWeights(tmp_path / "weights.json")
    assert applied.read() is None and applied.source() is None
    applied.keep(3, None, None, state, Stub(tok))  # a live update: a snapshot beside the record
    source, version = applied.read()
    assert version == 3 and source.hf == (tmp_path / "weights.json.v3").resolve()
    back = read_source(source)
    assert back.eos_id == eos_id(tok) and back.tokenizer.get_vocab() == tok.get_vocab()
    assert all(torch.equal(back.state[k], v) for k, v in state.items())
    applied.keep(4, None, None, state, Stub(tok))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.json", "weights.json.v4"]
    applied.keep(5, "some/run", tmp_path / "weights.json.v4", None, Stub(tok))  # a disk update: where it read
    assert applied.source() == {"source": str((tmp_path / "weights.json.v4").resolve()), "version": 5}
    applied.keep(6, "x", tmp_path / "nowhere", None, Stub(tok))  # recorded as named; the old snapshot goes
    assert not (tmp_path / "weights.json.v4").exists() and applied.source()["version"] == 6
    assert applied.read() is None  # gone from disk: the command line's weights, said in one line
