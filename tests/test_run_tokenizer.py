"""The run's tokenizer is decided in one place (``run_tokenizer``): which one wins, and every other
tokenizer the settings name refused by that setting, each compared once."""

import dataclasses

import pytest

from conftest import SMALL_CORPUS
from stalwart.config.job import DataConfig
from stalwart.data.corpus import Corpus, DataError
from stalwart.data.prepare import Source, prepare, tokenizer_sha256
from stalwart.data.prepared import Prepared, open_prepared
from stalwart.data.tokenizer import eos_id, load_tokenizer, run_tokenizer, train_bpe

pytestmark = pytest.mark.unit

BASE = DataConfig(path=SMALL_CORPUS, vocab_size=300, tokenizer_train_mb=0.05)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two different tokenizers on disk, and a dataset prepared with the first."""
    root = tmp_path_factory.mktemp("tok")
    corpus = Corpus(SMALL_CORPUS)
    ours, other = train_bpe(corpus.sample_text(50_000), 300), train_bpe(["another text entirely"] * 20, 280)
    (root / "ours.json").write_text(ours.to_str())
    (root / "other.json").write_text(other.to_str())
    prepare([Source("json", SMALL_CORPUS)], root / "data", ours, eos_id(ours))
    for name, tok in (("hf", ours), ("hf_other", other)):
        (root / name).mkdir()
        (root / name / "tokenizer.json").write_text(tok.to_str())
    (root / "hf_none").mkdir()
    return root, corpus


def _sha(path) -> str:
    return tokenizer_sha256(load_tokenizer(path))


def _decide(world, run, prepared=False, init="", **cfg):
    root, corpus = world
    data = open_prepared(root / "data") if prepared else None
    return run_tokenizer(dataclasses.replace(BASE, **cfg), run / "tokenizer.json", data,
                         None if prepared else corpus, str(root / init) if init else "")


def test_text_trains_once_and_a_resume_keeps_it(world, tmp_path):
    tok = _decide(world, tmp_path)
    assert tok.get_vocab_size() == 300 and (tmp_path / "tokenizer.json").is_file()
    first = (tmp_path / "tokenizer.json").read_text()
    # The run's own wins on resume, whatever data.tokenizer says now.
    again = _decide(world, tmp_path, tokenizer=str(world[0] / "other.json"))
    assert tokenizer_sha256(again) == tokenizer_sha256(tok) and (tmp_path / "tokenizer.json").read_text() == first
    assert _decide(world, tmp_path / "bytes", tokenizer="byte").get_vocab_size() == 257


def test_a_prepared_dataset_gives_its_tokenizer_and_refuses_another(world, tmp_path):
    root = world[0]
    _decide(world, tmp_path / "a", prepared=True)
    assert _sha(tmp_path / "a" / "tokenizer.json") == _sha(root / "data" / "tokenizer.json")
    with pytest.raises(DataError, match=r"^data.tokenizer: the tokenizer .* differs from the one"):
        _decide(world, tmp_path / "b", prepared=True, tokenizer=str(root / "other.json"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "tokenizer.json").write_text((root / "other.json").read_text())
    with pytest.raises(DataError, match=rf"^run directory {tmp_path / 'c'}: the tokenizer .* differs from the one"):
        _decide(world, tmp_path / "c", prepared=True)


def test_weights_from_hugging_face_bring_their_tokenizer(world, tmp_path):
    root = world[0]
    _decide(world, tmp_path / "a", init="hf")  # 'bpe' means: the weights' tokenizer, not a new BPE
    assert _sha(tmp_path / "a" / "tokenizer.json") == _sha(root / "hf" / "tokenizer.json")
    with pytest.raises(DataError, match=rf"^data.tokenizer: {root / 'other.json'} differs from "
                                        rf"{root / 'hf' / 'tokenizer.json'}"):
        _decide(world, tmp_path / "b", init="hf", tokenizer=str(root / "other.json"))
    with pytest.raises(DataError, match=rf"^checkpoint.init_from_hf: run directory {tmp_path / 'a'} already holds"):
        _decide(world, tmp_path / "a", init="hf_other")
    with pytest.raises(DataError, match=r"^checkpoint.init_from_hf: the tokenizer .* differs from the one"):
        _decide(world, tmp_path / "c", prepared=True, init="hf_other")
    with pytest.raises(DataError, match=rf"^checkpoint.init_from_hf: {root / 'hf_none'} has no tokenizer.json"):
        _decide(world, tmp_path / "d", init="hf_none")
    # Naming the tokenizer explicitly is the way out of a directory without one.
    _decide(world, tmp_path / "e", init="hf_none", tokenizer=str(root / "ours.json"))
    assert _sha(tmp_path / "e" / "tokenizer.json") == _sha(root / "ours.json")


def test_each_named_tokenizer_is_compared_with_the_data_once(world, tmp_path, monkeypatch):
    calls = []
    check = Prepared.check_tokenizer
    monkeypatch.setattr(Prepared, "check_tokenizer", lambda self, tok, where: calls.append(where) or
                        check(self, tok, where))
    root = world[0]
    _decide(world, tmp_path / "a", prepared=True, init="hf", tokenizer=str(root / "ours.json"))
    assert calls == ["data.tokenizer", str(root / "data" / "tokenizer.json")]
    calls.clear()
    _decide(world, tmp_path / "a", prepared=True)  # a resume: the run's own against the data, nothing else
    assert calls == [f"run directory {tmp_path / 'a'}"]
