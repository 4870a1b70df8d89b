import json
import threading

import numpy as np
import pytest
import torch

from conftest import SMALL_CORPUS
from stalwart.data.corpus import Corpus, DataError
from stalwart.data.loader import DataLoader, validation_batches
from stalwart.data.prepare import Source, prepare
from stalwart.data.prepared import open_prepared
from stalwart.data.tokenizer import eos_id, train_bpe

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def corpus():
    return Corpus(SMALL_CORPUS, val_fraction=0.2)


@pytest.fixture(scope="module")
def tok(corpus):
    return train_bpe(corpus.sample_text(100_000), 384)


@pytest.fixture(scope="module")
def data(corpus, tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    prepare([Source("json", SMALL_CORPUS)], out, tok, eos_id(tok), val_fraction=0.2, corpora=[corpus])
    return open_prepared(out)


def make_loader(data, rank=0, world=1, seed=0, global_batch=8, micro=2, seq=32, prefetch=0):
    return DataLoader(data.split("train"), data.names, [1.0], seq, global_batch, micro, rank, world, seed,
                      prefetch=prefetch)


def flat(batches):
    return torch.cat([b.inputs for b in batches])


def test_splits_are_disjoint_and_deterministic(corpus):
    again = Corpus(SMALL_CORPUS, val_fraction=0.2)
    assert [d.key for d in corpus.train] == [d.key for d in again.train]
    assert not {d.key for d in corpus.train} & {d.key for d in corpus.val}
    assert corpus.val


def test_order_is_deterministic_and_seeded(data):
    a, b, c = make_loader(data), make_loader(data), make_loader(data, seed=1)
    for _ in range(3):
        xa, xb, xc = flat(a.next()), flat(b.next()), flat(c.next())
        assert torch.equal(xa, xb)
    assert not torch.equal(xa, xc)


def test_global_shuffle_serves_every_sequence_once_per_epoch(data):
    seq = 32
    loader = make_loader(data, global_batch=1, micro=1, seq=seq)
    stream = data.split("train")[0]
    n = stream.tokens // seq
    in_order = [tuple(stream.read(k * seq, seq + 1)[:-1].tolist()) for k in range(n)]
    served = [tuple(r.tolist()) for _ in range(n) for r in flat(loader.next())]
    assert sorted(served[:n]) == sorted(in_order)  # a permutation of the epoch's sequences ...
    assert served[:n] != in_order  # ... not stream order
    neighbours = sum(in_order.index(served[i + 1]) - in_order.index(served[i]) == 1 for i in range(n - 1))
    assert neighbours < n // 10  # and without window locality


def test_targets_are_inputs_shifted(data):
    batch = make_loader(data).next()[0]
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])


def test_rank_shards_are_disjoint_and_cover_the_global_batch(data):
    single = make_loader(data, global_batch=8, micro=2)
    shards = [make_loader(data, rank=r, world=4, global_batch=8, micro=2) for r in range(4)]
    for _ in range(3):
        whole = flat(single.next())
        parts = [flat(s.next()) for s in shards]
        assert torch.equal(torch.cat(parts), whole)
        rows = {tuple(r.tolist()) for p in parts for r in p}
        assert len(rows) == whole.shape[0]  # no sequence served to two ranks


@pytest.mark.parametrize("skip", [7, 64])  # mid-epoch, and across the epoch boundary (66 batches)
def test_exact_resume_position(data, skip):
    straight = make_loader(data)
    assert (skip + 5 < straight.n_sequences[0] // 8) == (skip == 7)  # the 5 batches after 64 pass the end of epoch 0
    for _ in range(skip):
        straight.next()
    state = json.loads(json.dumps(straight.state_dict()))  # must survive JSON (the checkpoint format)
    expected = [flat(straight.next()) for _ in range(5)]
    with make_loader(data, prefetch=2) as resumed:  # the background thread gives the same batches
        resumed.load_state_dict(state)
        for want in expected:
            assert torch.equal(flat(resumed.next()), want)
    assert not any(t.name == "stalwart-data-prefetch" for t in threading.enumerate())  # closed


def test_resume_refuses_other_settings(data):
    state = make_loader(data).state_dict()
    with pytest.raises(DataError, match="global_batch 8 -> 4"):
        make_loader(data, global_batch=4).load_state_dict(state)


def test_bad_data_inputs(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        Corpus(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no documents found"):
        Corpus(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="matches no files"):
        Corpus(str(tmp_path / "*.nothing"))


def test_max_mb_reads_the_first_files_and_keys_the_cache_by_them(tmp_path):
    """data.max_mb: the first files in path order up to that size (at least one), and the data cache's
    key follows the files read, so a limited corpus never reuses the whole one's entry."""
    from pathlib import Path

    from stalwart.data.cache import data_key

    for i in range(5):
        (tmp_path / f"f{i}.txt").write_text(f"document {i} " * 50_000)  # ~0.55 MB each
    whole = Corpus(str(tmp_path), val_fraction=0.0)
    first = Corpus(str(tmp_path), val_fraction=0.0, max_mb=1.0)
    assert [Path(d.path).name for d in first.train] == ["f0.txt", "f1.txt"]  # f1 crosses 1 MB
    assert [Path(d.path).name for d in Corpus(str(tmp_path), val_fraction=0.0, max_mb=0.01).train] == ["f0.txt"]
    assert len(whole.train) == 5
    settings = dict(fmt="auto", text_field="text", val_fraction=0.0, decode_errors="auto", shard_mb=1.0)
    source = [Source("s", str(tmp_path))]
    assert data_key(source, [first], "t", **settings) != data_key(source, [whole], "t", **settings)


def test_jsonl_and_parquet_sources(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": f"row {i} says hello"} for i in range(20)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.parquet"):
        c = Corpus(str(tmp_path / name), val_fraction=0.1)
        # Every record is a document (the split hashes paths, so which rows are held out varies).
        assert {d.row for d in c.train} | {d.row for d in c.val} == set(range(20)) and c.val
        assert c.read(c.train[0]).startswith("row ")
    with pytest.raises(DataError, match="no column 'body'"):
        Corpus(str(tmp_path / "d.parquet"), text_field="body")
    bad = Corpus(str(tmp_path / "d.jsonl"), text_field="body", val_fraction=0.0)
    with pytest.raises(DataError, match="has no 'body' field"):
        bad.read(bad.train[0])


def test_global_batch_must_split_over_ranks(data):
    with pytest.raises(DataError, match="not divisible by the data-parallel size"):
        make_loader(data, world=3, global_batch=8)
    with pytest.raises(DataError, match="not a multiple of training.micro_batch"):
        make_loader(data, world=2, global_batch=8, micro=3)


def test_validation_set_spans_the_split_and_is_layout_independent(data):
    def val(rank, world):
        return flat(validation_batches(data.split("val"), [1.0], 32, 8, 2, rank, world))

    whole = val(0, 1)
    assert torch.equal(torch.cat([val(0, 2), val(1, 2)]), whole)
    stream = data.split("val")[0]
    assert stream.tokens > 8 * 33 * 4  # the split is much longer than the set: sequences are spread out
    contiguous = torch.stack([torch.from_numpy(stream.read(i * 32, 33)[:-1].copy()) for i in range(8)])
    assert not torch.equal(contiguous, whole)  # not simply the first sequences of the split


def test_text_is_strict_utf8_by_default_or_replaced_and_counted(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("ok text\n" * 20)
    (tmp_path / "latin.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1") * 10)
    strict = Corpus(str(tmp_path), val_fraction=0.0)
    latin = next(d for d in strict.train if d.path.endswith("latin.txt"))
    with pytest.raises(DataError, match=r"latin.txt is not valid UTF-8 \(byte 3: .*data.decode_errors = replace"):
        strict.read(latin)
    lenient = Corpus(str(tmp_path), val_fraction=0.0, decode_errors="replace")
    assert lenient.read(latin).startswith("caf\ufffd cr\ufffdme") and lenient.replaced == {latin.path: 20}
    lenient.read(latin)
    assert capsys.readouterr().err.count("20 byte(s) replaced by U+FFFD") == 1  # once per file
    (tmp_path / "rows.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    rows = Corpus(str(tmp_path / "rows.jsonl"), val_fraction=0.0)
    with pytest.raises(DataError, match="rows.jsonl record 1 is not valid UTF-8"):
        rows.read(rows.train[0])


def test_binary_data_is_refused_by_name(tmp_path):
    np.save(tmp_path / "tokens.npy", np.arange(100))
    with pytest.raises(DataError, match=r"binary data files no data.format reads \(.*tokens.npy\)"):
        Corpus(str(tmp_path / "tokens.npy"))
    with pytest.raises(DataError, match="tokens.npy"):
        Corpus(str(tmp_path))  # a directory does not skip it silently either
    (tmp_path / "tokens.npy").unlink()
    (tmp_path / "blob.dat").write_bytes(b"\x00\x01\x02" * 100)  # unknown suffix: the content decides
    with pytest.raises(DataError, match="blob.dat"):
        Corpus(str(tmp_path / "*.dat"))
    hf = tmp_path / "saved"
    hf.mkdir()
    for name in ("state.json", "dataset_info.json"):
        (hf / name).write_text("{}")
    (hf / "data-00000-of-00001.arrow").write_bytes(b"ARROW1\x00\x00")
    with pytest.raises(DataError, match=r"state.json is not a readable `datasets` state file"):
        Corpus(str(hf))


def test_a_corpus_hashed_wholly_into_validation_still_trains(tmp_path):
    # One file whose path hashes below the 2% threshold: every document would be held out.
    import zlib

    name = next(f"doc{i}.txt" for i in range(100_000)
                if zlib.crc32(str(tmp_path / f"doc{i}.txt").encode()) % 10_000 < 200)
    (tmp_path / name).write_text("hello world\n" * 50)
    corpus = Corpus(str(tmp_path / name))
    assert [d.key for d in corpus.train] == [str(tmp_path / name)] and corpus.val == corpus.train


def test_files_no_format_reads_are_left_out_with_a_warning(tmp_path, capsys):
    from stalwart.data.corpus import Corpus

    (tmp_path / "a.txt").write_text("some text\n" * 10)
    (tmp_path / "blob.dat").write_bytes(b"\x00\x01binary")
    (tmp_path / ".hidden").write_text("x")
    corpus = Corpus(str(tmp_path))
    assert {d.path for d in corpus.train + corpus.val} == {str(tmp_path / "a.txt")}
    err = capsys.readouterr().err
    assert "skipped 1 file(s)" in err and "blob.dat (binary)" in err and ".hidden" not in err
    Corpus(str(tmp_path))
    assert "skipped" not in capsys.readouterr().err  # once per directory
