"""The embeddings model's pieces: pairs mined from Python sources, the pairs dataset and its loader
rows, the text mask and pooling, the contrastive loss, and the checks that refuse a mismatched run."""

import json
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stalwart.data.loader import DataLoader
from stalwart.data.pairs import (Pair, encode_text, held_out, mine, mine_file, pair_rows, split, text_mask,
                                 write_dataset)
from stalwart.data.prepared import open_prepared
from stalwart.data.tokenizer import eos_id, train_bpe
from stalwart.models.embedding import pool
from stalwart.train.contrastive import ObjectiveError, check_objective, contrastive_loss

pytestmark = pytest.mark.unit

SOURCE = '''
import os

def top(a, b):
    """Add two numbers and return their sum.

    More words that are not the query.
    """
    return a + b

@staticmethod
def decorated(x):
    """Return the square of the given value."""
    y = x * x
    return y

def short():
    """Too short."""
    return 1

def only_doc():
    """A function whose body is only this docstring."""

class Box:
    def open(self, how):
        """Open the box in the given way, loudly."""
        self.state = how
        return self
'''


def test_mining_takes_first_paragraph_code_without_docstring_and_qualified_names(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(SOURCE)
    pairs = {p.id: p for p in mine_file(path, "pkg.mod")}
    assert set(pairs) == {"pkg.mod:top", "pkg.mod:decorated", "pkg.mod:Box.open"}
    top = pairs["pkg.mod:top"]
    assert top.query == "Add two numbers and return their sum."
    assert top.document == "def top(a, b):\n    return a + b"
    assert pairs["pkg.mod:decorated"].document.startswith("@staticmethod\ndef decorated(x):")
    assert "Open the box" not in pairs["pkg.mod:Box.open"].document


def test_mining_drops_ambiguous_pairs_and_holds_out_whole_packages(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.py").write_text(SOURCE)
    assert mine(tmp_path) == []  # every query occurs twice: none can be told apart
    root = Path(sysconfig.get_paths()["stdlib"]) / "email"
    pairs = mine(root)
    assert len(pairs) > 100
    train, held = split(pairs, 30)
    assert train and held and len(train) + len(held) == len(pairs)
    assert not {p.module.split(".")[0] for p in train} & {p.module.split(".")[0] for p in held}
    assert held_out("email", 30) == held_out("email", 30)


def test_text_mask_and_pool_ignore_padding_after_the_end_token():
    end = 9
    rows = torch.tensor([[1, 2, end, end, end], [3, end, end, end, end], [4, 5, 6, 7, end]])
    mask = text_mask(rows, end)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    out = torch.randn(3, 5, 4)
    e = pool(out, mask)
    assert torch.allclose(e.norm(dim=-1), torch.ones(3))
    changed = out.clone()
    changed[0, 3:] = 100.0  # what padding positions hold does not matter
    assert torch.equal(pool(changed, mask), e)
    assert torch.allclose(e[1], torch.nn.functional.normalize(out[1, :2].mean(0), dim=-1))


def test_contrastive_loss_prefers_matching_pairs():
    loss = contrastive_loss(0.05)
    mask = torch.ones(8, 3, dtype=torch.int64)
    base = torch.eye(6)[:4, None, :].expand(4, 3, 6)  # four orthogonal texts
    matched = torch.stack([base, base], dim=1).reshape(8, 3, 6)     # query i == document i
    shuffled = torch.stack([base, base.roll(1, 0)], dim=1).reshape(8, 3, 6)
    assert float(loss(matched, mask)) < 0.01 < float(loss(shuffled, mask))


def test_pairs_dataset_rows_alternate_query_and_document_with_their_masks(tmp_path):
    pairs = [Pair(f"m:f{i}", "m", f"query number {i} words", f"def f{i}():\n    return {i} * {i}") for i in range(12)]
    tok = train_bpe([p.query + "\n" + p.document for p in pairs] * 20, 300)
    end = eos_id(tok)
    index = write_dataset({"docstring": (pairs[:8], pairs[8:])}, tmp_path, tok, end, 32)
    assert index["pairs"] == {"half": 16}
    data = open_prepared(tmp_path)
    data.verify(full=True)
    loader = DataLoader(data.split("train"), data.names, [1.0], 32, 4, 2, 0, 1, 0, prefetch=0, pairs=(16, end))
    batches = loader.next()
    assert len(batches) == 2 and batches[0].inputs.shape == (4, 16) and batches[0].targets.shape == (4, 16)
    queries = {tuple(encode_text(tok, p.query, 16, end)) for p in pairs[:8]}
    docs = {tuple(encode_text(tok, p.document, 16, end)) for p in pairs[:8]}
    for b in batches:
        for r, (row, mask) in enumerate(zip(b.inputs.tolist(), b.targets.tolist())):
            text = tuple(row[:sum(mask)])
            assert text in (queries if r % 2 == 0 else docs)
            assert all(t == end for t in row[sum(mask):])
    rows, masks = pair_rows(torch.from_numpy(np.stack([data.split("train")[0].read(0, 32)])), 16, end)
    assert rows.shape == (2, 16) and masks[0].sum() == len(encode_text(tok, pairs[0].query, 16, end))


_DIMS = SimpleNamespace(pp=1, cp=1, tp=1)
_LM, _EMB = SimpleNamespace(embed_dim=0), SimpleNamespace(embed_dim=32)
_CONTRASTIVE, _PLAIN = SimpleNamespace(objective="contrastive", micro_batch=4), SimpleNamespace(objective="lm", micro_batch=4)


@pytest.mark.parametrize("training, model, pair_len, dims, says", [
    (_CONTRASTIVE, _EMB, 16, _DIMS, None),
    (_PLAIN, _LM, 0, _DIMS, None),
    (_CONTRASTIVE, _LM, 16, _DIMS, "model.embed_dim"),
    (_CONTRASTIVE, _EMB, 0, _DIMS, "stalwart data pairs"),
    (_CONTRASTIVE, _EMB, 16, SimpleNamespace(pp=2, cp=1, tp=1), "tp, pp and cp"),
    (SimpleNamespace(objective="contrastive", micro_batch=1), _EMB, 16, _DIMS, "micro_batch >= 2"),
    (_PLAIN, _EMB, 0, _DIMS, "--training.objective contrastive"),
    (_PLAIN, _LM, 16, _DIMS, "pairs dataset"),
])
def test_objective_checks_name_the_fix(training, model, pair_len, dims, says):
    if says is None:
        check_objective(training, model, pair_len, dims)
        return
    with pytest.raises(ObjectiveError, match=says):
        check_objective(training, model, pair_len, dims)


def test_an_embeddings_model_starts_from_a_language_models_body_and_a_seeded_head(tmp_path):
    import dataclasses

    from stalwart.export.hf import export_hf, read_hf, from_hf_state
    from stalwart.models.flavors import TransformerArgs
    from stalwart.models.llama import Transformer

    lm = TransformerArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, ffn_hidden=64,
                         max_seq_len=32, tie_embeddings=True)
    torch.manual_seed(0)
    state = Transformer(lm).state_dict()
    tok = train_bpe(["def f(x):\n    return x + 1\n"] * 50, 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    export_hf(state, lm, tmp_path / "tokenizer.json", "<|endoftext|>", eos_id(tok), tmp_path / "hf")
    config, tensors = read_hf(tmp_path / "hf")
    emb = dataclasses.replace(lm, tie_embeddings=False, embed_dim=16)
    got = from_hf_state(config, tensors, emb)
    assert "output.weight" not in got  # the head is new: it keeps the seeded init
    assert set(got) == set(state) - {"output.weight"}
    for name, t in got.items():
        assert torch.equal(t, state[name].float()), name
    with pytest.raises(Exception, match="hidden_size"):  # another body is still refused
        from_hf_state(config, tensors, dataclasses.replace(emb, dim=64, n_heads=4))
