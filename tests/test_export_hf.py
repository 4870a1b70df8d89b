"""Hugging Face export/import: logits match transformers' LlamaForCausalLM, and the round trip is exact."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import TINY_RUN, run_cli
from stalwart.checkpoint.inspect import digest
from stalwart.export.hf import ExportError, export_hf, from_hf_rope, from_hf_state, load_hf_into, read_hf, to_hf_rope
from stalwart.models.flavors import TransformerArgs
from stalwart.models.llama import Transformer
from stalwart.train.init import materialize_and_init

transformers = pytest.importorskip("transformers")

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=96, max_seq_len=32,
                       rope_theta=10000.0)


def build(args: TransformerArgs, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    materialize_and_init(model, torch.device("cpu"), seed)
    return model.eval()


def _tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|endoftext|>"])
    path = tmp_path / "tok.json"
    tok.save(str(path))
    return path


@pytest.mark.unit
def test_rope_permutation_is_inverted_by_import():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(from_hf_rope(to_hf_rope(w, 4), 4), w)
    assert not torch.equal(to_hf_rope(w, 4), w)


@pytest.mark.unit
@pytest.mark.parametrize("tie", [True, False])
def test_export_matches_transformers_and_round_trips(tmp_path, tie):
    args = dataclasses.replace(ARGS, tie_embeddings=tie)
    model = build(args)
    state = {k: v for k, v in model.state_dict().items()}
    out = tmp_path / "hf"
    export_hf(state, args, _tokenizer(tmp_path), "<|endoftext|>", 0, out)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                "tokenizer_config.json"}
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    # Import back: bit-identical weights and logits.
    config, tensors = read_hf(out)
    back = from_hf_state(config, tensors, args)
    for k, v in state.items():
        assert torch.equal(back[k], v), k
    fresh = build(args, seed=7)
    load_hf_into(fresh, args, out)
    with torch.no_grad():
        assert torch.equal(fresh(tokens), ours)


@pytest.mark.unit
def test_sharded_export_writes_an_index(tmp_path):
    model = build(ARGS)
    out = tmp_path / "hf"
    files = export_hf(model.state_dict(), ARGS, _tokenizer(tmp_path), "<|endoftext|>", 0, out,
                      max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "model.safetensors.index.json" in files
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = torch.randint(0, ARGS.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5


@pytest.mark.unit
def test_import_refuses_a_mismatched_shape(tmp_path):
    model = build(ARGS)
    out = tmp_path / "hf"
    export_hf(model.state_dict(), ARGS, _tokenizer(tmp_path), "<|endoftext|>", 0, out)
    with pytest.raises(ExportError, match="hidden_size"):
        load_hf_into(build(dataclasses.replace(ARGS, dim=32, ffn_hidden=48)),
                     dataclasses.replace(ARGS, dim=32, ffn_hidden=48), out)
    # Same shapes, another function: every such field is named, none is silently dropped.
    cfg = json.loads((out / "config.json").read_text())
    for key, value in (("rope_theta", 500000.0), ("rms_norm_eps", 1e-6), ("hidden_act", "gelu"),
                       ("tie_word_embeddings", not ARGS.tie_embeddings),
                       ("rope_scaling", {"rope_type": "llama3", "factor": 8.0})):
        (out / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ExportError, match=f"config.json has {key} = "):
            load_hf_into(build(ARGS), ARGS, out)
    (out / "config.json").write_text(json.dumps(cfg))
    load_hf_into(build(ARGS), ARGS, out)
    (out / "model.safetensors").unlink()
    (out / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ExportError, match="never pickles"):
        read_hf(out)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """The run both CLI tests export (neither changes it)."""
    run = tmp_path_factory.mktemp("export") / "src"
    run_cli("train", "--run.dir", str(run), *TINY_RUN, "--training.steps", "2", "--sample.max_new_tokens", "0")
    return run


@pytest.mark.e2e
def test_cli_export_then_init_from_hf(tmp_path, src):
    from stalwart.cli.generate import load_run_model

    dst, hf_dir = tmp_path / "dst", tmp_path / "hf"
    run_cli("export", "--run", str(src), "--format", "hf", "--out", str(hf_dir))
    model, _, _, path = load_run_model(src)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert tok.eos_token == "<|endoftext|>"
    # Import as initial weights; with lr = 0 the first checkpoint holds exactly the imported weights.
    proc = run_cli("train", "--run.dir", str(dst), *TINY_RUN, "--training.steps", "2", "--optimizer.lr", "0",
            "--data.tokenizer", str(src / "tokenizer.json"), "--checkpoint.init_from_hf", str(hf_dir),
            "--sample.max_new_tokens", "0")
    assert digest(dst / "checkpoints" / "step-2", "model.") == digest(path, "model.")
    events = [json.loads(x) for x in (dst / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "initialized" and e["source"] == "hf" for e in events)
    assert f"initialised from Hugging Face {hf_dir}" in proc.stdout
    # The same weights under another RoPE base: refused by name through the CLI, nothing trained.
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "rope_theta": 500000.0}))
    bad = run_cli("train", "--run.dir", str(tmp_path / "bad"), *TINY_RUN, "--training.steps", "2",
                  "--data.tokenizer", str(src / "tokenizer.json"), "--checkpoint.init_from_hf", str(hf_dir),
                  check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"stalwart train: error: checkpoint.init_from_hf {hf_dir}: config.json has rope_theta = 500000.0, but this "
        f"run's model has 10000.0 (--model.rope_theta)"]


@pytest.mark.unit
def test_reexport_replaces_the_weights_of_an_earlier_export(tmp_path):
    import os

    model = build(ARGS)
    out = tmp_path / "hf"
    tok = _tokenizer(tmp_path)
    old_mask = os.umask(0o022)
    try:
        export_hf(build(ARGS, seed=3).state_dict(), ARGS, tok, "<|endoftext|>", 0, out, max_shard_bytes=64 * 1024)
        (out / "README.md").write_text("kept")
        (out / "model-notes.safetensors.txt").write_text("kept: not a name export writes")
        files = export_hf(model.state_dict(), ARGS, tok, "<|endoftext|>", 0, out)
    finally:
        os.umask(old_mask)
    weights = sorted(p.name for p in out.iterdir() if "safetensors" in p.name)
    assert weights == ["model-notes.safetensors.txt", "model.safetensors"] and "model.safetensors" in files
    assert (out / "README.md").read_text() == "kept"
    # The weights are readable like every other file of the export (umask 022 -> 0644).
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}
    config, tensors = read_hf(out)
    back = from_hf_state(config, tensors, ARGS)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    # Both layouts side by side (two exports mixed by hand): refused, never guessed.
    export_hf(model.state_dict(), ARGS, tok, "<|endoftext|>", 0, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    for p in (tmp_path / "sharded").glob("model*"):
        p.rename(out / p.name)
    with pytest.raises(ExportError, match="holds both model.safetensors and model.safetensors.index.json"):
        read_hf(out)


@pytest.mark.unit
def test_import_refuses_tensors_of_another_shape_than_config_json(tmp_path):
    small = dataclasses.replace(ARGS, dim=32, ffn_hidden=48)
    out, ref = tmp_path / "hf", tmp_path / "ref"
    export_hf(build(ARGS).state_dict(), ARGS, _tokenizer(tmp_path), "<|endoftext|>", 0, out)
    export_hf(build(small).state_dict(), small, _tokenizer(tmp_path), "<|endoftext|>", 0, ref)
    (out / "config.json").write_text((ref / "config.json").read_text())  # config of one model, weights of another
    with pytest.raises(ExportError, match=r"^checkpoint.init_from_hf .*: tensor 'model.embed_tokens.weight' has "
                                          r"shape \(128, 64\), but config.json describes \(128, 32\)"):
        load_hf_into(build(small), small, out)


def _one_error_line(proc, starts: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(starts), proc.stderr
    return lines[0]


@pytest.mark.e2e
def test_cli_export_and_import_refuse_what_does_not_fit(tmp_path, src):
    big, hf_dir = tmp_path / "big", tmp_path / "hf"
    run_cli("train", "--run.dir", str(big), *TINY_RUN, "--training.steps", "2", "--sample.max_new_tokens", "0",
            "--model.dim", "128")
    # A checkpoint of another run's shape: refused, nothing written.
    ckpt = big / "checkpoints" / "step-2"
    line = _one_error_line(run_cli("export", "--run", str(src), "--checkpoint", str(ckpt), "--out", str(hf_dir),
                                   check=False), f"stalwart export: error: --checkpoint {ckpt}: tensor ")
    assert "(" in line and "128)" in line and not hf_dir.exists()
    for bad in ("0", "-1"):
        _one_error_line(run_cli("export", "--run", str(src), "--out", str(hf_dir), "--max-shard-gb", bad,
                                check=False), "stalwart export: error: --max-shard-gb must be a positive")
    assert not hf_dir.exists()
    # A sharded export replaced by a single-file one: the import reads the new weights.
    run_cli("export", "--run", str(big), "--out", str(hf_dir), "--max-shard-gb", "0.0005")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    run_cli("export", "--run", str(src), "--out", str(hf_dir))
    assert sorted(p.name for p in hf_dir.glob("model*")) == ["model.safetensors"]
    # No --data.tokenizer: the run adopts the HF directory's tokenizer instead of training a new BPE.
    dst = tmp_path / "dst"
    run_cli("train", "--run.dir", str(dst), *TINY_RUN, "--training.steps", "1", "--sample.max_new_tokens", "0",
            "--checkpoint.init_from_hf", str(hf_dir))
    assert (dst / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    # A tokenizer given by path that is not the HF directory's: refused by name.
    other = tmp_path / "other.json"
    other.write_text((src / "tokenizer.json").read_text().replace('"<|endoftext|>"', '"<|end|>"'))
    _one_error_line(run_cli("train", "--run.dir", str(tmp_path / "t1"), *TINY_RUN, "--training.steps", "1",
                            "--data.tokenizer", str(other), "--checkpoint.init_from_hf", str(hf_dir), check=False),
                    f"stalwart train: error: data.tokenizer: {other} differs from {hf_dir / 'tokenizer.json'}")
    # Weights of another shape than config.json says: one line naming the first tensor, before training.
    big_hf = tmp_path / "big_hf"
    run_cli("export", "--run", str(big), "--out", str(big_hf))
    (big_hf / "config.json").write_text((hf_dir / "config.json").read_text())
    line = _one_error_line(run_cli("train", "--run.dir", str(tmp_path / "t2"), *TINY_RUN, "--training.steps", "1",
                                   "--checkpoint.init_from_hf", str(big_hf), check=False),
                           f"stalwart train: error: checkpoint.init_from_hf {big_hf}: tensor 'model.embed_tokens")
    assert "but config.json describes" in line
    # No tokenizer.json in the HF directory and none given: refused rather than training a mismatched BPE.
    (hf_dir / "tokenizer.json").unlink()
    _one_error_line(run_cli("train", "--run.dir", str(tmp_path / "t3"), *TINY_RUN, "--training.steps", "1",
                            "--checkpoint.init_from_hf", str(hf_dir), check=False),
                    f"stalwart train: error: checkpoint.init_from_hf: {hf_dir} has no tokenizer.json")
