"""The embedded store (LanceDB), its where clauses, the crash-safe ingest's checks, and tenant isolation:
a query, count or delete scoped to tenant A never reads, counts or deletes tenant B's rows, whatever the
filter, ids or text it carries."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stalwart.retrieval import query as q
from stalwart.retrieval.ingest import digest, ingest, read_chunks
from stalwart.retrieval.lance import AnnParams, LanceStore, read_manifest
from stalwart.retrieval.open import open_store
from stalwart.retrieval.records import Chunk, IndexError_

pytestmark = pytest.mark.unit

DIM = 16


def unit_vectors(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


# -- where clauses -------------------------------------------------------------------------------------

def test_where_clause_is_tenant_then_quoted_tag_membership():
    w = q.where_clause("acme", {"source": "it's.py", "year": 2020, "lang": {"in": ["py", "rs"]}})
    assert w == ("tenant = 'acme' AND array_has(tags, 'source=\"it''s.py\"') AND array_has(tags, 'year=2020') "
                 "AND array_has_any(tags, ['lang=\"py\"', 'lang=\"rs\"'])")
    assert q.tag("x", 1.0) == q.tag("x", 1) == "x=1" and q.tag("x", True) == "x=true" and q.tag("x", "1") == 'x="1"'
    assert q.tag("x", "é'") == "x=\"\\u00e9'\""  # non-ASCII travels as JSON escapes


@pytest.mark.parametrize("filters", [
    {"1=1 OR": 1}, {"tenant' OR '1'='1": "x"}, {"Source": "a"}, {"a b": 1}, {"x": {"gt": 1}}, {"x": {"in": []}},
    {"x": {"in": "abc"}}, {"x": {"in": [1], "or": 2}}, {"x": {"y": {"z": 1}}}, {"x": [1, 2]}, {"x": None},
    {"x": float("nan")}, {"x\n": "a"}, {"é": 1}, "tenant = 'B'", ["x"], {f"k{i}": 1 for i in range(17)},
])
def test_crafted_filters_are_refused_with_one_line(filters):
    with pytest.raises(IndexError_) as e:
        q.where_clause("acme", filters)
    assert "\n" not in str(e.value)


def test_quotes_in_filter_values_stay_inside_one_literal():
    w = q.where_clause("A", {"tenant": "B' OR tenant = 'B", "k": "x') OR (1=1"})
    # Both values are one literal each: nothing outside quotes but the fixed clause's shape.
    outside = "".join(part for i, part in enumerate(w.split("'")) if i % 2 == 0)
    assert outside == "tenant =  AND array_has(tags, ) AND array_has(tags, )"


@pytest.mark.parametrize("tenant", ["", "a b", "a'b", "-a", "x" * 65, "é", None, "a\n"])
def test_bad_tenant_names_are_refused(tenant):
    with pytest.raises(IndexError_):
        q.where_clause(tenant)


def test_filter_flags_parse_json_or_text():
    assert q.parse_filter_args(["year=2020", 'name="2020"', "src=a.py", 'lang=["py","rs"]', "ok=true"]) == {
        "year": 2020, "name": "2020", "src": "a.py", "lang": {"in": ["py", "rs"]}, "ok": True}
    for bad in (["novalue"], ["=1"], ['x={"a":1}'], ["x=null"], ["x=1", "x=2"], ["Bad=1"]):
        with pytest.raises(IndexError_):
            q.parse_filter_args(bad)


def test_rrf_fuses_by_reciprocal_rank_deterministically():
    fused = q.rrf([["a", "b", "c"], ["c", "b", "d"]], k=3)
    assert [i for i, _ in fused] == ["c", "b", "a"]  # 1/63 + 1/61 > 2/62 > 1/61
    assert fused[1][1] == pytest.approx(2 / 62) and q.rrf([[], []], 5) == []
    assert q.rrf([["y", "x"], ["x", "y"]], k=2) == q.rrf([["x", "y"], ["y", "x"]], k=2)  # a tie: the id decides
    assert [i for i, _ in q.rrf([["y", "x"], ["x", "y"]], k=2)] == ["x", "y"]


# -- the store -----------------------------------------------------------------------------------------

def test_store_manifest_vector_keyword_hybrid_delete(tmp_path: Path):
    store = open_store(str(tmp_path / "ix"), dim=DIM, create=True)
    man = read_manifest(tmp_path / "ix")
    assert man["dim"] == DIM and man["embedder"] == "" and man["created_version"] and man["ann"] is None
    chunks = [Chunk(f"c{i}", "A", f"apple pie number {i}" if i % 4 else f"banana bread {i}",
                    {"src": f"f{i % 3}", "n": i}) for i in range(60)]
    vecs = unit_vectors(60, 0)
    store.add(chunks, vecs)
    query = unit_vectors(1, 1)[0]
    exact = np.argsort(-(vecs @ query))[:5]
    hits = store.search("A", vector=query, mode="vector", k=5)
    assert [h.id for h in hits] == [f"c{i}" for i in exact]
    assert [h.score for h in hits] == pytest.approx(list((vecs @ query)[exact]), abs=1e-5)
    kw = store.search("A", text="banana", mode="keyword", k=20)
    assert sorted(h.id for h in kw) == sorted(f"c{i}" for i in range(0, 60, 4))
    hy = store.search("A", vector=query, text="banana", mode="hybrid", k=5, filters={"src": {"in": ["f0", "f1"]}})
    assert len(hy) == 5 and all(h.meta["src"] in ("f0", "f1") for h in hy)
    assert [h.meta["n"] for h in store.search("A", vector=query, mode="vector", k=3, filters={"n": 7})] == [7]
    assert store.count("A") == 60 and store.count("B") == 0
    assert store.committed_ids(["c1", "c2", "nope"]) == {"c1", "c2"}
    assert store.delete("A", ["c1", "c2", "nope"]) == 2 and store.count("A") == 58
    with pytest.raises(IndexError_):
        store.search("A", vector=np.ones(DIM + 1), mode="vector")
    with pytest.raises(IndexError_):
        store.search("A", text="x", mode="vector")
    with pytest.raises(IndexError_, match="not an empty directory"):
        LanceStore(tmp_path / "ix", dim=DIM, create=True)
    with pytest.raises(IndexError_, match="not an index"):
        open_store(str(tmp_path / "missing"))
    with pytest.raises(IndexError_, match="unknown store address"):
        open_store("mysql://x")


@pytest.mark.parametrize("kind", ["auto", "IVF_HNSW_SQ", "IVF_PQ", "IVF_FLAT"])
def test_ann_index_meets_recall_against_exact(tmp_path: Path, kind: str):
    store = LanceStore(tmp_path / "ix", dim=DIM, create=True)
    n = 3000
    vecs = unit_vectors(n, 2)
    store.add([Chunk(f"c{i}", "A" if i % 3 else "B", "t") for i in range(n)], vecs)
    store.add([Chunk(f"s{i}", "S", "t") for i in range(5)], unit_vectors(5, 9))
    ann = store.build_indexes(AnnParams(kind), min_rows=1000)
    assert ann and ann["kind"] == (kind if kind != "auto" else "IVF_FLAT")  # auto below 128 dimensions
    assert read_manifest(tmp_path / "ix")["ann"] == ann
    a_rows = np.array([i for i in range(n) if i % 3])
    recall = []
    for query in unit_vectors(20, 3):
        exact = {f"c{i}" for i in a_rows[np.argsort(-(vecs[a_rows] @ query))[:10]]}
        got = store.search("A", vector=query, mode="vector", k=10)
        assert all(h.tenant == "A" for h in got)
        recall.append(len(exact & {h.id for h in got}) / 10)
    assert np.mean(recall) >= 0.9, recall
    # a tenant of 5 rows among 3000 gets all 5 through the vector index's pre-filter
    assert sorted(h.id for h in store.search("S", vector=unit_vectors(1, 3)[0], mode="vector", k=10)) == \
        [f"s{i}" for i in range(5)]


# -- tenant isolation ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_tenants(tmp_path_factory) -> LanceStore:
    store = LanceStore(tmp_path_factory.mktemp("iso") / "ix", dim=DIM, create=True)
    texts = [f"the quick brown fox {i} jumps" for i in range(40)]
    vecs = unit_vectors(40, 4)
    # Same texts and vectors under both tenants; B also has texts of its own and the metadata A filters on.
    a = [Chunk(f"a{i}", "A", texts[i], {"src": f"f{i % 2}"}) for i in range(40)]
    b = [Chunk(f"b{i}", "B", texts[i] + (" secret zebra" if i % 2 else ""), {"src": f"f{i % 2}", "tenant": "A"})
         for i in range(40)]
    store.add(a, vecs)
    store.add(b, vecs)
    return store


ESCAPES = [None, {"src": "f0"}, {"tenant": "B"}, {"tenant": "A"}, {"src": {"in": ["f0", "f1", "' OR tenant='B"]}},
           {"src": "f0' OR tenant = 'B"}, {"src": "x') OR (tenant = 'B"}]


@pytest.mark.parametrize("mode", ["vector", "keyword", "hybrid"])
@pytest.mark.parametrize("filters", ESCAPES)
def test_queries_scoped_to_a_never_return_b(two_tenants, mode, filters):
    store = two_tenants
    for text in ("the quick brown fox 3 jumps secret zebra", "zebra", "b3 b5 B", "fox"):
        for vec in unit_vectors(3, 5):
            hits = store.search("A", vector=vec, text=text, mode=mode, k=100, filters=filters)
            assert all(h.tenant == "A" and h.id.startswith("a") for h in hits), hits
    assert store.search("A", text="zebra", mode="keyword", k=100) == []  # only B's texts hold it


def test_counts_deletes_and_unknown_tenants_stay_scoped(two_tenants, tmp_path):
    store = two_tenants
    assert store.count("A") == 40 and store.count("B") == 40 and store.count("C") == 0
    assert store.delete("A", [f"b{i}" for i in range(40)]) == 0 and store.count("B") == 40
    assert store.search("C", vector=unit_vectors(1, 6)[0], text="fox", mode="hybrid") == []
    for bad in ("A' OR '1'='1", "A OR 1=1", "A\n"):
        with pytest.raises(IndexError_):
            store.count(bad)
        with pytest.raises(IndexError_):
            store.delete(bad, ["b1"])
    assert store.count("B") == 40


# -- ingest --------------------------------------------------------------------------------------------

def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(n: int, seed: int = 0, tenant: str = "A") -> list[dict]:
    v = unit_vectors(n, seed)
    return [{"id": f"r{i}", "tenant": tenant, "text": f"row {i}", "vector": v[i].tolist()} for i in range(n)]


def test_ingest_resumes_by_batch_and_refuses_changed_or_partial(tmp_path: Path):
    src = write_jsonl(tmp_path / "in.jsonl", rows(25))
    store = LanceStore(tmp_path / "ix", dim=DIM, create=True)
    chunks, lines = read_chunks(src, DIM)
    committed = []

    class Crash(Exception):
        pass

    def stop_after_two(k, n):
        committed.append(k)
        if len(committed) == 2:
            raise Crash

    with pytest.raises(Crash):
        ingest(store, chunks, lines, batch=10, on_commit=stop_after_two)
    assert store.count("A") == 20
    rep = ingest(store, chunks, lines, batch=10)
    assert (rep.batches, rep.skipped, rep.added) == (3, 2, 1) and store.count("A") == 25
    assert ingest(store, chunks, lines, batch=10).added == 0 and store.count("A") == 25
    version = store.version()
    with pytest.raises(IndexError_, match="batch 0 .* partly in the index"):
        ingest(store, chunks + read_chunks(write_jsonl(tmp_path / "x.jsonl", [rows(30)[29] | {"id": "new"}]),
                                           DIM)[0], lines + [26], batch=30)
    changed = rows(25)
    changed[7]["text"] = "edited"
    ch, ln = read_chunks(write_jsonl(tmp_path / "changed.jsonl", changed), DIM)
    with pytest.raises(IndexError_, match="changed.jsonl:8: id 'r7' is already in the index with different content"):
        ingest(store, ch, ln, batch=10, where=str(tmp_path / "changed.jsonl"))
    assert store.version() == version  # nothing written by a refused ingest
    assert digest(ch[0]) == digest(chunks[0]) != digest(ch[7])


@pytest.mark.parametrize("line, match", [
    ("not json", "bad.jsonl:2: not JSON"),
    (json.dumps({"id": "r0", "tenant": "A", "text": "dup", "vector": [1.0] * DIM}),
     "bad.jsonl:2: id 'r0' is also on line 1"),
    (json.dumps({"id": "x", "tenant": "A", "text": "t", "vector": [1.0] * 3}), "has 3 numbers; this index holds 16"),
    (json.dumps({"id": "x", "tenant": "a b", "text": "t"}), "is not a tenant name"),
])
def test_read_chunks_names_the_bad_line(tmp_path: Path, line: str, match: str):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(rows(1)[0]) + "\n" + line + "\n")
    with pytest.raises(IndexError_, match=match):
        read_chunks(src, DIM)


def test_vectors_normalised_and_zero_vectors_refused(tmp_path: Path):
    store = LanceStore(tmp_path / "ix", dim=DIM, create=True)
    r = rows(2)
    r[0]["vector"] = [2.0] + [0.0] * (DIM - 1)
    r[1]["vector"] = [0.0] * DIM
    chunks, lines = read_chunks(write_jsonl(tmp_path / "in.jsonl", r), DIM)
    with pytest.raises(IndexError_, match="in.jsonl:2: chunk 'r1': its vector is zero"):
        ingest(store, chunks, lines, batch=1, where=str(tmp_path / "in.jsonl"))
    assert store.count("A") == 0  # refused before anything was written
    ingest(store, chunks[:1], lines[:1], batch=1)
    hit = store.search("A", vector=np.eye(DIM, dtype=np.float32)[0], mode="vector", k=1)[0]
    assert hit.id == "r0" and hit.score == pytest.approx(1.0)


def test_names_with_a_trailing_newline_are_refused():
    from stalwart.retrieval.records import check_meta, check_tenant

    with pytest.raises(IndexError_):
        check_tenant("acme\n")
    with pytest.raises(IndexError_):
        check_meta({"src\n": "a"}, "chunk")
