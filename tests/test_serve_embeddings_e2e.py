"""`stalwart serve` of an embeddings model through the real CLI, spoken to with OpenAI's own client:
/v1/embeddings in floats and base64 equal to ``Embedder.embed`` of the same texts, many concurrent
requests batched into shared forwards and each equal to its answer alone, bad input answered with
OpenAI's error body while the server keeps serving, /health, /metrics, /v1/models."""

from __future__ import annotations

import base64
import subprocess
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import popen_cli, run_cli

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.e2e

# Batched and alone, a text's vector goes through matrix products of other shapes: equal to float32
# rounding (measured on this model: at most 6e-8, 31 of 48 texts bitwise), far below any ranking difference.
TOL = 1e-6
TEXTS = ["Return the JSON encoding of an object.", "def dumps(obj):\n    return encode(obj)", "decoder",
         "Deserialize a str instance containing a JSON document to a Python object.", "x = [1, 2, 3]"]


def tiny_embedder(root: Path) -> Path:
    """An embeddings model trained 5 steps on docstring/code pairs of the json package: ``root/run``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    run_cli("data", "pairs", "--out", str(root / "pairs"), "--root", str(stdlib / "json"), "--seq-len", "64",
            "--vocab-size", "300")
    run_cli("train", "--data.path", str(root / "pairs"), "--data.seq_len", "64", "--training.objective",
            "contrastive", "--model.embed_dim", "32", "--model.flavor", "debug", "--training.steps", "5",
            "--training.global_batch", "8", "--training.micro_batch", "8", "--sample.max_new_tokens", "0",
            "--launch.nproc_per_node", "1", "--run.dir", str(root / "run"))
    return root / "run"


def start_server(tmp: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    """`stalwart serve ARGS` on a free loopback port: (process, base URL, its log)."""
    port_file, log = tmp / f"port-{time.monotonic_ns()}", tmp / f"serve-{time.monotonic_ns()}.log"
    with open(log, "w") as out:
        proc = popen_cli("serve", *args, "--port", "0", "--port-file", str(port_file), stdout=out,
                         stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not port_file.is_file():
        assert proc.poll() is None, f"server exited {proc.returncode}: {log.read_text()}"
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}", log


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from stalwart.retrieval.embed import Embedder

    root = tmp_path_factory.mktemp("emb")
    run = tiny_embedder(root)
    proc, url, log = start_server(root, "--run", str(run), "--embeddings.max_inputs", "8",
                                  "--embeddings.max_batch_tokens", "256")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        yield url, client, Embedder(run), run.name
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()


def test_floats_base64_and_token_ids_equal_the_embedder(served):
    url, client, emb, name = served
    want = emb.embed(TEXTS)
    r = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == name and [d.index for d in r.data] == list(range(len(TEXTS)))
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert got.shape == (len(TEXTS), emb.dim)
    assert np.abs(got - want).max() <= TOL
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(row) for row in emb.encode(TEXTS))
    b64 = client.embeddings.create(model=name, input=TEXTS, encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b64.data])
    assert np.array_equal(decoded, got)  # the same forward's bits, in the other encoding
    # The client's default asks for base64 and decodes it.
    plain = client.embeddings.create(model=name, input=TEXTS[0])
    assert np.abs(np.array(plain.data[0].embedding) - want[0]).max() <= TOL
    rows = [emb.tokenizer.encode(t).ids for t in TEXTS[:2]]
    ids = client.embeddings.create(model=name, input=rows, encoding_format="float")
    assert np.abs(np.array([d.embedding for d in ids.data]) - want[:2]).max() <= TOL
    one = client.embeddings.create(model=name, input=rows[0], encoding_format="float")
    assert np.abs(np.array(one.data[0].embedding) - want[0]).max() <= TOL


def test_an_over_long_text_is_truncated_as_training_truncates(served):
    url, client, emb, name = served
    long = " ".join(f"word{i}" for i in range(400))
    r = client.embeddings.create(model=name, input=[long], encoding_format="float")
    assert r.usage.prompt_tokens == emb.max_tokens
    assert np.abs(np.array(r.data[0].embedding) - emb.embed([long])[0]).max() <= TOL


def test_concurrent_requests_share_forwards_and_equal_their_single_answers(served):
    url, client, emb, name = served
    texts = [f"{TEXTS[i % len(TEXTS)]} #{i}" for i in range(48)]
    alone = {t: np.array(client.embeddings.create(model=name, input=t, encoding_format="float").data[0].embedding)
             for t in texts[:12]}
    before = _batches(url)

    def ask(i: int) -> list[np.ndarray]:
        batch = texts[i:i + 1 + i % 3]
        r = client.embeddings.create(model=name, input=batch, encoding_format="float")
        return batch, [np.array(d.embedding) for d in r.data]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(len(texts))))
    diffs = []
    for batch, vectors in answers:
        assert len(vectors) == len(batch)
        for t, v in zip(batch, vectors):
            if t in alone:
                diffs.append(np.abs(v - alone[t]).max())
    want = emb.embed([t for batch, _ in answers for t in batch])
    got = np.concatenate([np.stack(v) for _, v in answers])
    assert np.abs(got - want).max() <= TOL and diffs and max(diffs) <= TOL
    forwards = _batches(url) - before
    assert 0 < forwards < len(texts), forwards  # requests shared forwards
    assert httpx.get(url + "/health").json()["status"] == "ok"


def _batches(url: str) -> int:
    return httpx.get(url + "/health").json()["batches"]


def test_bad_input_is_a_4xx_in_openais_shape_and_the_server_keeps_serving(served):
    url, client, emb, name = served
    post = lambda body: httpx.post(url + "/v1/embeddings", json=body, timeout=30)  # noqa: E731
    cases = [({"input": []}, 400, "input"), ({"input": ""}, 400, "input"), ({"input": ["a", ""]}, 400, "input"),
             ({"input": ["a"] * 9}, 400, "input"), ({"input": ["a", 5]}, 400, "input"), ({"input": [[]]}, 400, "input"),
             ({"input": [1, 10**6]}, 400, "input"), ({"input": "a", "dimensions": 8}, 400, "dimensions"),
             ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"), ({}, 400, "input"),
             ({"input": "a", "model": "other"}, 404, "model")]
    for body, status, param in cases:
        r = post(body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and err["type"], (body, err)
    assert "a string, a list of strings" in post({"input": ["a", 5]}).json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="embeddings model"):
        client.completions.create(model=name, prompt="def ", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="/v1/embeddings"):
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
    r = client.embeddings.create(model=name, input=TEXTS[:1], dimensions=emb.dim, encoding_format="float")
    assert len(r.data[0].embedding) == emb.dim


def test_health_models_and_metrics(served):
    url, client, emb, name = served
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["dim"] == emb.dim
    assert [m.id for m in client.models.list().data] == [name]
    client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    text = httpx.get(url + "/metrics").text
    for series in ("stalwart_embeddings_requests_total", "stalwart_embeddings_tokens_total",
                   "stalwart_embeddings_batch_rows_bucket", "stalwart_embeddings_forward_seconds_bucket",
                   "stalwart_embeddings_queued_inputs"):
        assert series in text, series
    assert 'outcome="rejected"' in text or 'outcome="ok"' in text
