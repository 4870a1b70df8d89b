"""An embeddings model trained through `stalwart train` keeps the training guarantees: two processes
(FSDP) stopped and resumed go bit for bit like the uninterrupted run; the exported model embeds like
the run it came from; a mismatched run is refused in one line."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_RUN, assert_same_states, run_cli

pytestmark = pytest.mark.e2e

EMAIL = str(Path(sysconfig.get_paths()["stdlib"]) / "email")


def _without(flags: list[str], *names: str) -> list[str]:
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in names:
            skip = True
        else:
            out.append(f)
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pairs")
    proc = run_cli("data", "pairs", "--out", str(out), "--root", EMAIL, "--seq-len", "64", "--vocab-size", "300",
                   "--tokenizer-train-mb", "0.2", "--held-out", "30")
    assert "training pairs" in proc.stdout
    return out


def _common(pairs: Path) -> list[str]:
    base = _without(TINY_RUN, "--data.path", "--data.seq_len", "--data.vocab_size", "--data.tokenizer_train_mb",
                    "--data.val_fraction", "--training.global_batch", "--training.micro_batch")
    return [*base, "--data.path", str(pairs), "--data.seq_len", "64", "--training.objective", "contrastive",
            "--model.embed_dim", "16", "--training.global_batch", "8", "--training.micro_batch", "4",
            "--training.steps", "6", "--launch.nproc_per_node", "2", "--checkpoint.interval", "3",
            "--eval.interval", "3"]


@pytest.fixture(scope="module")
def plain(pairs, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("plain") / "run"
    run_cli("train", *_common(pairs), "--run.dir", str(run))
    return run


def test_two_processes_stopped_and_resumed_go_bit_for_bit_and_export_embeds_alike(pairs, plain, tmp_path):
    resumed = tmp_path / "resumed"
    run_cli("train", *_common(pairs), "--run.dir", str(resumed), "--training.stop_at_step", "3")
    run_cli("train", *_common(pairs), "--run.dir", str(resumed))
    assert_same_states(plain, resumed)

    run_cli("export", "--run", str(plain), "--format", "hf", "--out", str(tmp_path / "hf"))
    from stalwart.retrieval.embed import Embedder

    texts = ["Return the header value.", "def get(self, name):\n    return self._headers[name]", "x"]
    from_run, from_hf = Embedder(plain), Embedder(tmp_path / "hf")
    assert from_run.dim == 16
    a, b = from_run.embed(texts), from_hf.embed(texts)
    assert a.shape == (3, 16) and np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("flags, says", [
    (["--model.embed_dim", "0"], "set --model.embed_dim"),
    (["--training.objective", "lm"], "--training.objective contrastive"),
    (["--data.seq_len", "32"], "--data.seq_len 64"),
])
def test_a_mismatched_run_is_refused_in_one_line(pairs, tmp_path, flags, says):
    proc = run_cli("train", *_common(pairs), "--launch.nproc_per_node", "1", "--run.dir", str(tmp_path / "r"),
                   *flags, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_retrieval_bench_scores_bm25_the_embedder_and_hybrid_through_the_store(pairs, plain, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "retrieval", "--pairs", str(pairs), "--embedder", str(plain), "--limit", "20",
                   "--out", str(out))
    assert "recall@10 BM25" in proc.stdout and "model GFLOP/s" in proc.stdout, proc.stdout
    import json

    (r,) = json.loads(out.read_text())
    for mode in ("keyword", "vector", "hybrid"):
        assert 0.0 <= r[mode]["recall@1"] <= r[mode]["recall@10"] <= 1.0
    assert r["keyword"]["recall@10"] > 0.3  # the queries' own words are in their functions' code
    assert r["speed"]["chunks_per_s"] > 0 and r["embed_dim"] == 16
