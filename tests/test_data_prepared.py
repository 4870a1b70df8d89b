"""Prepared datasets: shard layout, resumable and idempotent preparation, refusal of damaged data,
the same tokens from every input format, mixtures and the global shuffle (pure logic, in process)."""

import json
import struct

import numpy as np
import pytest

from conftest import SMALL_CORPUS
from stalwart.data.corpus import Corpus, DataError
from stalwart.data.loader import DataLoader, validation_batches
from stalwart.data.mixture import apportion, batch_plan, parse_mix, permutation_key, permute
from stalwart.data.prepare import Source, prepare
from stalwart.data.prepared import open_prepared
from stalwart.data.tokenizer import eos_id, train_bpe

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return train_bpe(Corpus(SMALL_CORPUS).sample_text(100_000), 300)


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_interrupted_prepare_resumes_to_the_same_bytes(tok, tmp_path):
    eos = eos_id(tok)
    whole = tmp_path / "whole"
    prepare([Source("json", SMALL_CORPUS)], whole, tok, eos, shard_mb=0.001)
    index = json.loads((whole / "index.json").read_text())
    assert len(index["sources"][0]["train"]["shards"]) >= 3

    class Stop(Exception):
        pass

    def stop_after_two(state):
        if state["shards"] == 2:
            raise Stop

    part = tmp_path / "part"
    with pytest.raises(Stop):
        prepare([Source("json", SMALL_CORPUS)], part, tok, eos, shard_mb=0.001, progress=stop_after_two)
    assert not (part / "index.json").exists()
    (part / "json.train.00001.bin").write_bytes(b"damaged")  # a finished shard that no longer matches is redone
    seen = []
    prepare([Source("json", SMALL_CORPUS)], part, tok, eos, shard_mb=0.001, progress=seen.append)
    assert seen[0]["shards"] == 1  # one finished shard kept, the damaged one and the rest redone
    assert _files(part) == _files(whole)
    with pytest.raises(DataError, match="--out: .* other inputs"):
        prepare([Source("json", SMALL_CORPUS)], part, tok, eos, shard_mb=0.002)


def test_shards_are_megatron_bin_idx_and_hold_each_document_then_eos(tok, tmp_path):
    corpus = Corpus(SMALL_CORPUS, val_fraction=0.0)
    prepare([Source("json", SMALL_CORPUS)], tmp_path, tok, eos_id(tok), val_fraction=0.0)
    idx = (tmp_path / "json.train.00000.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", idx, 9)
    assert (version, code, n_seq, n_doc) == (1, 8, len(corpus.train), len(corpus.train) + 1)
    lengths = np.frombuffer(idx, np.int32, n_seq, 34)
    pointers = np.frombuffer(idx, np.int64, n_seq, 34 + 4 * n_seq)
    tokens = np.fromfile(tmp_path / "json.train.00000.bin", dtype=np.uint16)
    for doc, n, ptr in zip(corpus.train, lengths, pointers):
        want = tok.encode(corpus.read(doc), add_special_tokens=False).ids + [eos_id(tok)]
        assert tokens[ptr // 2:ptr // 2 + n].tolist() == want


def _write_formats(tmp_path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": t}) + "\n\n" for t in texts))
    pq.write_table(pa.table({"text": texts}), tmp_path / "rows.parquet", row_group_size=7)
    # The layout `datasets.Dataset.save_to_disk` writes: Arrow IPC stream files listed in state.json.
    hf = tmp_path / "hf"
    hf.mkdir()
    table = pa.table({"text": texts, "id": list(range(len(texts)))})
    with pa.OSFile(str(hf / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=9)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                               "_fingerprint": "x", "_split": "train"}))
    (hf / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    return ["rows.jsonl", "rows.parquet", "hf"]


def test_jsonl_parquet_and_datasets_inputs_give_the_same_tokens(tok, tmp_path):
    texts = [f"record {i}: " + "lorem ipsum " * (i % 5) for i in range(40)]
    want = np.concatenate([tok.encode(t, add_special_tokens=False).ids + [eos_id(tok)] for t in texts])
    for name in _write_formats(tmp_path, texts):
        out = tmp_path / f"out-{name}"
        prepare([Source("s", str(tmp_path / name))], out, tok, eos_id(tok), val_fraction=0.0, shard_mb=0.0002)
        stream = open_prepared(out).split("train")[0]
        assert np.array_equal(stream.read(0, stream.tokens), want), name


def test_damaged_data_and_another_tokenizer_are_refused_by_name(tok, tmp_path):
    prepare([Source("json", SMALL_CORPUS)], tmp_path, tok, eos_id(tok))
    data = open_prepared(tmp_path)
    data.verify()
    shard = tmp_path / "json.train.00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    data.verify(full=False)  # same size: only the checksum sees it
    with pytest.raises(DataError, match=r"shard .*json.train.00000.bin fails its checksum"):
        data.verify()
    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError, match=r"json.train.00000.bin holds .* bytes, its index says"):
        data.verify(full=False)
    shard.unlink()
    with pytest.raises(DataError, match=r"cannot read shard .*json.train.00000.bin"):
        data.verify(full=False)
    other = train_bpe(["something else entirely"] * 10, 280)
    with pytest.raises(DataError, match=r"data.tokenizer: the tokenizer .* differs from the one"):
        data.check_tokenizer(other, "data.tokenizer")


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4099])
def test_permutation_is_a_bijection_and_seeded(n):
    out = permute(np.arange(n), n, permutation_key(1, 2, 3))
    assert sorted(out.tolist()) == list(range(n))
    if n > 3:
        assert not np.array_equal(out, permute(np.arange(n), n, permutation_key(1, 2, 4)))


def test_mixture_proportions_are_exact_per_batch_and_over_the_run():
    weights = parse_mix("a:0.7, b:0.2,c:0.1", ["a", "b", "c"])
    G = 10
    for b in range(200):
        src, seq = batch_plan(b, G, weights, [13, 5, 1000], seed=3)
        counts = np.bincount(src, minlength=3)
        assert counts.sum() == G and np.all(np.abs(counts - np.array(weights) * G) < 1 + 1e-9)
    # Uneven weights: per batch within one sequence, and the running totals exact to rounding.
    weights = parse_mix("a:0.55,b:0.45", ["a", "b"])
    totals = np.zeros(2, dtype=np.int64)
    for b in range(101):
        src, _ = batch_plan(b, 8, weights, [50, 50], seed=0)
        counts = np.bincount(src, minlength=2)
        assert np.all(np.abs(counts - np.array(weights) * 8) < 1 + 1e-9)
        totals += counts
        assert np.array_equal(totals, apportion((b + 1) * 8, weights))
    with pytest.raises(DataError, match="data.mix: 'z:1' is not SOURCE:WEIGHT"):
        parse_mix("z:1", ["a", "b"])


def test_each_source_serves_a_permutation_per_epoch_across_batches():
    from collections import Counter

    n = [6, 10]  # 4 sequences of each source per batch: batches straddle both sources' epoch ends
    served = [Counter(), Counter()]
    for b in range(15):
        src, seq = batch_plan(b, 8, [0.5, 0.5], n, seed=5)
        for s in (0, 1):
            served[s].update(seq[src == s].tolist())
            counts = [served[s][k] for k in range(n[s])]
            assert max(counts) - min(counts) <= 1  # no sequence twice before every one once
            assert sum(counts) == 4 * (b + 1)


def test_mixed_loader_and_validation_draw_from_every_source(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["zzz qqq " * 40] * 30}), tmp_path / "other.parquet")
    prepare([Source("json", SMALL_CORPUS), Source("other", str(tmp_path / "other.parquet"))], tmp_path / "d",
            tok, eos_id(tok), val_fraction=0.2)
    data = open_prepared(tmp_path / "d")
    weights = parse_mix("json:0.75,other:0.25", data.names)
    loader = DataLoader(data.split("train"), data.names, weights, 16, 8, 4, 0, 1, seed=0, prefetch=0)
    for _ in range(3):
        loader.next()
    assert loader.source_tokens() == {"data_tokens/json": 18 * 16, "data_tokens/other": 6 * 16}
    zzz = tok.encode("zzz qqq", add_special_tokens=False).ids[0]
    val = np.concatenate([b.inputs.numpy() for b in validation_batches(data.split("val"), weights, 16, 4, 2, 0, 1)])
    from_other = [zzz in row for row in val]
    assert any(from_other) and not all(from_other)
