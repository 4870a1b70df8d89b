"""`stalwart index` end to end: build, query, add, delete, stats through the real CLI; bad input is one line,
exit 2, and the index as it was; an `index add` killed with SIGKILL and re-run ends equal, bit for bit, to an
uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from stalwart.bench.retrieval_ingest import compare, create_empty, kill_and_resume, synthetic_chunks

pytestmark = pytest.mark.e2e

DIM = 8


def chunk_rows(n: int, seed: int = 0) -> list[dict]:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return [{"id": f"c{i}", "tenant": "acme" if i % 2 else "globex",
             "text": f"apple pie recipe {i}" if i % 3 else f"banana bread {i}",
             "meta": {"src": f"f{i % 4}", "year": 2020 + i % 2}, "vector": v[i].tolist()} for i in range(n)]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stats(ix: Path) -> dict:
    return json.loads(run_cli("index", "stats", str(ix), "--json").stdout)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("ix")
    rows = chunk_rows(200)
    out = run_cli("index", "build", str(root / "ix"), "--chunks", str(write(root / "in.jsonl", rows)), "--batch", "64")
    assert "200 chunks in 4 batches (dim 8)" in out.stdout and out.stdout.count("committed batch") == 4
    return root / "ix", rows


def test_build_query_modes_and_filters(built, tmp_path):
    ix, rows = built
    st = stats(ix)
    assert st["rows"] == 200 and st["tenants"] == {"acme": 100, "globex": 100} and st["dim"] == DIM
    qv = np.asarray(rows[5]["vector"], dtype=np.float32)
    (tmp_path / "q.json").write_text(json.dumps(qv.tolist()))
    hits = json.loads(run_cli("index", "query", str(ix), "--tenant", "acme", "--vector-file", str(tmp_path / "q.json"),
                              "--k", "5", "--json").stdout)
    acme = [r for r in rows if r["tenant"] == "acme"]
    vecs = np.asarray([r["vector"] for r in acme], dtype=np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    assert [h["id"] for h in hits] == [acme[i]["id"] for i in np.argsort(-(vecs @ (qv / np.linalg.norm(qv))))[:5]]
    kw = json.loads(run_cli("index", "query", str(ix), "--tenant", "acme", "--text", "banana", "--k", "100",
                            "--filter", "src=f1", "--filter", "year=2021", "--json").stdout)
    assert kw and {(h["tenant"], h["meta"]["src"], h["meta"]["year"]) for h in kw} == {("acme", "f1", 2021)}
    assert all("banana" in h["text"] for h in kw)
    hy = run_cli("index", "query", str(ix), "--tenant", "globex", "--text", "banana", "--vector-file",
                 str(tmp_path / "q.json"), "--filter", 'src=["f0","f2"]', "--json").stdout
    assert {h["tenant"] for h in json.loads(hy)} == {"globex"} and len(json.loads(hy)) == 10


def test_add_is_idempotent_and_delete_is_scoped(tmp_path):
    rows = chunk_rows(50)
    src = write(tmp_path / "in.jsonl", rows)
    run_cli("index", "build", str(tmp_path / "ix"), "--chunks", str(src), "--batch", "20")
    out = run_cli("index", "add", str(tmp_path / "ix"), "--chunks", str(src), "--batch", "20").stdout
    assert "0 batches added, 3 already committed" in out
    more = write(tmp_path / "more.jsonl", [r | {"id": "n" + r["id"]} for r in rows[:10]])
    assert "1 batches added" in run_cli("index", "add", str(tmp_path / "ix"), "--chunks", str(more)).stdout
    # c0 and c2 belong to globex: deleting them as acme deletes nothing of globex
    out = run_cli("index", "delete", str(tmp_path / "ix"), "--tenant", "acme", "--ids", "c0,c1,c2,c3").stdout
    assert "deleted 2 of 4" in out
    assert stats(tmp_path / "ix")["tenants"] == {"acme": 28, "globex": 30}


def test_bad_input_is_one_line_and_leaves_the_index(built, tmp_path):
    ix, rows = built
    before = stats(ix)
    good = rows[0] | {"id": "fresh"}
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps(good) + "\n{not json\n")
    cases = [
        (["index", "query", str(tmp_path / "missing"), "--tenant", "acme", "--text", "x"], "is not an index"),
        (["index", "add", str(ix), "--chunks", str(bad_json)], "bad.jsonl:2: not JSON"),
        (["index", "add", str(ix), "--chunks", str(write(tmp_path / "dim.jsonl", [good | {"vector": [1.0] * 3}]))],
         "has 3 numbers; this index holds 8"),
        (["index", "add", str(ix), "--chunks", str(write(tmp_path / "t.jsonl", [good | {"tenant": "a'b"}]))],
         "is not a tenant name"),
        (["index", "add", str(ix), "--chunks", str(write(tmp_path / "chg.jsonl", [rows[3] | {"text": "changed"}]))],
         "chg.jsonl:1: id 'c3' is already in the index with different content"),
        (["index", "query", str(ix), "--tenant", "acme' OR '1'='1", "--text", "x"], "is not a tenant name"),
        (["index", "query", str(ix), "--tenant", "acme", "--text", "x", "--filter", "tenant' OR 1=1 --=x"],
         "must be 1-32 lowercase letters"),
        (["index", "query", str(ix), "--tenant", "acme", "--text", "x", "--filter", 'src={"gt": 1}'],
         "must be a string"),
        (["index", "query", str(ix), "--tenant", "acme", "--text", "x", "--mode", "vector"], "needs --vector-file"),
        (["index", "delete", str(ix), "--tenant", "acme", "--ids", "a\x01b"], "control character"),
        (["index", "build", str(ix), "--chunks", str(bad_json)], "is not an empty directory"),
        (["index", "build", str(tmp_path / "new"), "--chunks", str(bad_json)], "bad.jsonl:2: not JSON"),
    ]
    for args, words in cases:
        p = run_cli(*args, check=False)
        assert p.returncode == 2 and words in p.stderr and p.stderr.count("\n") == 1, (args, p.stderr)
    assert not (tmp_path / "new").exists()
    assert stats(ix) == before


def test_kill9_during_add_then_rerun_equals_uninterrupted(tmp_path):
    n, dim, batch = 20_000, 16, 500
    chunks = synthetic_chunks(tmp_path / "chunks.jsonl", n, dim, tenants=3, seed=1)
    res = kill_and_resume(tmp_path, chunks, n, dim, batch, kills=3, seed=7, max_delay=0.2, log=lambda s: None,
                          ann_min_rows=10**9)  # the rows, not the vector index's build, are under test
    assert res["compare"]["equal"] and res["compare"]["rows"] == [n, n], res
    assert any(not k["finished_before_kill"] for k in res["kills"]), res  # at least one run really was killed
    # and the compare itself can fail: a different index differs
    from stalwart.retrieval.ingest import ingest, read_chunks
    from stalwart.retrieval.lance import LanceStore

    other = tmp_path / "other"
    create_empty(other, dim)
    ingest(LanceStore(other), *read_chunks(chunks, dim), batch=batch)
    assert compare(tmp_path / "clean", other)["equal"]
    LanceStore(other).delete("t0", ["doc-0000003"])
    assert not compare(tmp_path / "clean", other)["equal"]


def test_bad_index_command_lines_fail_before_the_store_is_imported(built, tmp_path):
    """A refusal costs a fraction of a second: lancedb's import (about 2 s of CPU) comes after the checks."""
    import subprocess
    import sys

    from conftest import REPO, cli_env
    from test_cli_startup import PROBE  # runs command lines in one process, naming the heavy modules loaded

    ix, _ = built
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    cases = [["index", "query", str(ix), "--tenant", "a b", "--text", "x"],
             ["index", "query", str(ix), "--tenant", "a", "--text", "x", "--filter", "Bad=1"],
             ["index", "query", str(tmp_path / "none"), "--tenant", "a", "--text", "x"],
             ["index", "add", str(ix), "--chunks", str(bad)],
             ["index", "build", str(tmp_path / "n"), "--chunks", str(bad)],
             ["index", "delete", str(ix), "--tenant", "a", "--ids", "x\x02"], ["index", "stats"], ["index", "nope"]]
    cases = [[" ".join(argv), argv, 2] for argv in cases]
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases), json.dumps(["lancedb", "torch"])],
                          capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for argv, code, _, err, heavy in json.loads(proc.stdout):
        assert code == 2 and len(err) == 1 and heavy == [], (argv, code, err, heavy)


def test_an_index_built_with_the_embedder_embeds_chunks_and_query_text(tmp_path):
    from test_serve_embeddings_e2e import tiny_embedder

    model = tiny_embedder(tmp_path)
    texts = ["Return the JSON encoding of an object.", "Deserialize a JSON document to a Python object.",
             "def dumps(obj):\n    return encode(obj)", "x = [1, 2, 3]", "Decode a JSON string."]
    src = write(tmp_path / "docs.jsonl", [{"id": f"d{i}", "tenant": "acme", "text": t} for i, t in enumerate(texts)])
    out = run_cli("index", "build", str(tmp_path / "ix"), "--chunks", str(src), "--embedder", str(model),
                  "--batch", "2").stdout
    assert "5 chunks in 3 batches (dim 32)" in out
    st = stats(tmp_path / "ix")
    assert st["embedder"].startswith("run@") and st["rows"] == 5
    for i in (0, 2):  # a chunk's own text, embedded at query time, finds that chunk first
        hits = json.loads(run_cli("index", "query", str(tmp_path / "ix"), "--tenant", "acme", "--text", texts[i],
                                  "--mode", "vector", "--k", "5", "--json").stdout)
        assert hits[0]["id"] == f"d{i}" and hits[0]["score"] == pytest.approx(1.0, abs=1e-5)
    more = write(tmp_path / "more.jsonl", [{"id": "d9", "tenant": "acme", "text": "Serialize obj to a JSON string."}])
    assert "1 batches added" in run_cli("index", "add", str(tmp_path / "ix"), "--chunks", str(more)).stdout
    hy = json.loads(run_cli("index", "query", str(tmp_path / "ix"), "--tenant", "acme", "--text",
                            "Serialize obj to a JSON string.", "--json").stdout)  # hybrid: the default with an embedder
    assert hy[0]["id"] == "d9"
