"""Hugging Face Llama format: export a run's checkpoint, and import HF weights as initial weights.

A mixture-of-experts model uses the Mixtral layout (same attention and norms; ``hf_moe.py`` maps the
router and the experts).

Names map one to one (``layers.i.attention.wq`` <-> ``model.layers.i.self_attn.q_proj``, ...). The one
non-trivial difference is RoPE: Stalwart rotates interleaved channel pairs ``(x[2i], x[2i+1])``, HF
Llama rotates halves ``(x[i], x[i + d/2])``. Permuting the rows of ``wq``/``wk`` within each head
(even channels first, then odd) makes the two compute the same function; import applies the inverse.

Only safetensors and JSON are read or written: nothing is unpickled.
"""

from __future__ import annotations

import dataclasses

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from stalwart.errors import UserError
from stalwart.export import hf_moe
from stalwart.models.flavors import TransformerArgs

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
SAFE_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class ExportError(UserError):
    pass


# ---------------------------------------------------------------------- RoPE layout
def to_hf_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection, interleaved pairs -> rotate-half. w: (n_heads * head_dim, dim)."""
    rows, cols = w.shape
    hd = rows // n_heads
    return w.view(n_heads, hd // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def from_hf_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    hd = rows // n_heads
    return w.view(n_heads, 2, hd // 2, cols).transpose(1, 2).reshape(rows, cols)


# ---------------------------------------------------------------------- names
def _layer_map(i: int, sparse: bool) -> list[tuple[str, str]]:
    p, q = f"layers.{i}.", f"model.layers.{i}."
    ffn = hf_moe.router_names(i) if sparse else [
        (p + "feed_forward.w1.weight", q + "mlp.gate_proj.weight"),
        (p + "feed_forward.w3.weight", q + "mlp.up_proj.weight"),
        (p + "feed_forward.w2.weight", q + "mlp.down_proj.weight")]
    return [(p + "attention.wq.weight", q + "self_attn.q_proj.weight"),
            (p + "attention.wk.weight", q + "self_attn.k_proj.weight"),
            (p + "attention.wv.weight", q + "self_attn.v_proj.weight"),
            (p + "attention.wo.weight", q + "self_attn.o_proj.weight"),
            *ffn,
            (p + "attention_norm.weight", q + "input_layernorm.weight"),
            (p + "ffn_norm.weight", q + "post_attention_layernorm.weight")]


def name_map(args: TransformerArgs) -> list[tuple[str, str]]:
    """(stalwart name, HF name) for every stored tensor mapped one to one (the tied head is stored once, as
    the embedding; stacked experts are mapped by ``hf_moe``)."""
    out = [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    for i in range(args.n_layers):
        out += _layer_map(i, args.is_moe_layer(i))
    if not args.tie_embeddings:
        out.append(("output.weight", "lm_head.weight"))
    return out


def check_exportable(args: TransformerArgs) -> None:
    if args.parallel_block:
        raise ExportError("model.parallel_block = true has no Hugging Face Llama equivalent; cannot export")
    if args.sliding_window:
        raise ExportError("model.sliding_window has no Hugging Face Llama equivalent; cannot export")
    if args.moe is not None:
        hf_moe.check_mixtral(args)


def hf_config(args: TransformerArgs, eos: int | None, dtype: str = "float32") -> dict[str, Any]:
    llama = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rope_scaling": None, "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "initializer_range": args.init_std, "use_cache": True, "torch_dtype": dtype, "dtype": dtype,
        "bos_token_id": eos, "eos_token_id": eos,
    }
    if args.embed_dim:  # an embeddings model: lm_head projects to embed_dim (mean-pooled, normalised)
        llama.update(architectures=["StalwartEmbedder"], stalwart_embed_dim=args.embed_dim)
    return hf_moe.mixtral_config(args, llama) if args.moe is not None else llama


def args_from_hf(config: dict[str, Any], where: str) -> TransformerArgs:
    """The Stalwart shape of a Hugging Face Llama config.json (the inverse of ``hf_config``)."""
    if config.get("model_type") != "llama":
        raise ExportError(f"{where}: model_type is {config.get('model_type')!r}; only Llama models load")
    if config.get("rope_scaling"):
        raise ExportError(f"{where}: rope_scaling {config['rope_scaling']} is not supported")
    try:
        args = TransformerArgs(
            dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
            n_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            vocab_size=config["vocab_size"], ffn_hidden=config["intermediate_size"],
            max_seq_len=config.get("max_position_embeddings", 2048),
            rope_theta=float(config.get("rope_theta", 10000.0)), norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            embed_dim=int(config.get("stalwart_embed_dim", 0)))
    except KeyError as e:
        raise ExportError(f"{where}: config.json has no {e.args[0]}") from None
    args.validate()
    if config.get("head_dim", args.head_dim) != args.head_dim:
        raise ExportError(f"{where}: head_dim {config['head_dim']} differs from hidden_size / heads ({args.head_dim})")
    return args


# ---------------------------------------------------------------------- shapes
def model_shapes(args: TransformerArgs) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor in the state dict of the model ``args`` describes (built on the meta device:
    no memory). A tensor mapped one to one by ``name_map`` has the same shape in the HF layout."""
    from stalwart.models.llama import Transformer

    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}


def first_shape_mismatch(have: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]]
                         ) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """(name, shape in ``have``, shape in ``want``) of the first tensor of ``want`` whose shape differs
    in ``have``; tensors absent from ``have`` are left to the caller (it names them as missing)."""
    for name, shape in want.items():
        t = have.get(name)
        if isinstance(t, torch.Tensor) and tuple(t.shape) != shape:
            return name, tuple(t.shape), shape
    return None


def shape_words(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


# ---------------------------------------------------------------------- export
def to_hf_state(state: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Stalwart full state dict (unprefixed names) -> HF tensors."""
    out = {}
    for ours, theirs in name_map(args):
        if ours not in state:
            raise ExportError(f"checkpoint has no tensor '{ours}'")
        t = state[ours].detach().cpu()
        if ours.endswith("attention.wq.weight"):
            t = to_hf_rope(t, args.n_heads)
        elif ours.endswith("attention.wk.weight"):
            t = to_hf_rope(t, args.n_kv_heads)
        out[theirs] = t.contiguous().clone()
    if args.moe is not None:
        out.update(hf_moe.experts_to_hf(state, args))
    return out


def _file_mode() -> int:
    """The mode ``open()`` gives a new file under the process umask (0644 under umask 022)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    # safetensors writes through a private temporary file (0600); give the weights the mode every other
    # file of the export has.
    os.chmod(path, _file_mode())


def weight_files(directory: Path) -> list[Path]:
    """The weight files an export writes that are present in ``directory``."""
    return sorted(p for p in directory.iterdir() if p.is_file() and (
        p.name in (SAFE_SINGLE, SAFE_INDEX) or SAFE_SHARD.fullmatch(p.name)))


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> list[str]:
    """One model.safetensors, or shards + model.safetensors.index.json when larger than max_shard_bytes.
    Weight files of an earlier export in ``out`` that this one does not rewrite are removed afterwards
    (a stale index or single file would otherwise be read instead of the new weights)."""
    written = _write_weights(tensors, out, max_shard_bytes)
    for stale in weight_files(out):
        if stale.name not in written:
            stale.unlink()
    return written


def _write_weights(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> list[str]:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= max_shard_bytes:
        _save_safetensors(tensors, out / SAFE_SINGLE)
        return [SAFE_SINGLE]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_safetensors(shard, out / fname)
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    (out / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=1))
    return names + [SAFE_INDEX]


def write_tokenizer(tokenizer_json: Path, out: Path, eos_token: str, max_len: int) -> None:
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "bos_token": eos_token,
        "unk_token": None, "pad_token": None, "model_max_length": max_len, "clean_up_tokenization_spaces": False,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos_token, "bos_token": eos_token}))


def export_hf(state: dict[str, torch.Tensor], args: TransformerArgs, tokenizer_json: Path, eos_token: str,
              eos: int | None, out: Path, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    check_exportable(args)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_hf_state(state, args)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config(args, eos, dtype), indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eos, "eos_token_id": eos}))
    files = write_safetensors(tensors, out, max_shard_bytes)
    write_tokenizer(tokenizer_json, out, eos_token, args.max_seq_len)
    return ["config.json", "generation_config.json", *files, "tokenizer.json", "tokenizer_config.json"]


# ---------------------------------------------------------------------- import
def read_config(directory: str | Path, where: str = "checkpoint.init_from_hf") -> dict[str, Any]:
    """config.json of an HF directory; errors start with ``where`` (the option the user set)."""
    cfg_path = Path(directory) / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"{where}: {directory} has no config.json (not a Hugging Face model directory)")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{where}: {cfg_path} is not valid JSON ({e})") from None


def read_hf(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of an HF directory; safetensors only."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(directory)
    config = read_config(d)
    if (d / SAFE_INDEX).is_file() and (d / SAFE_SINGLE).is_file():
        raise ExportError(f"checkpoint.init_from_hf: {d} holds both {SAFE_SINGLE} and {SAFE_INDEX} (weights of "
                          "two exports); remove the stale one, or export again into an empty directory")
    if (d / SAFE_INDEX).is_file():
        files = sorted(set(json.loads((d / SAFE_INDEX).read_text())["weight_map"].values()))
    elif (d / SAFE_SINGLE).is_file():
        files = [SAFE_SINGLE]
    else:
        raise ExportError(f"checkpoint.init_from_hf: {d} has no {SAFE_SINGLE} or {SAFE_INDEX} "
                          "(only safetensors are loaded, never pickles)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if os.sep in f or f.startswith(".."):
            raise ExportError(f"checkpoint.init_from_hf: index names a file outside {d}: {f}")
        try:
            tensors.update(load_file(str(d / f)))
        except (SafetensorError, OSError) as e:
            raise ExportError(f"checkpoint.init_from_hf: cannot read {d / f}: {e}") from None
    return config, tensors


# HF config field -> (this run's value, HF's default when absent, how to match it). Every field that
# changes the function the weights compute is here; a difference is refused, never silently dropped.
def _hf_expectations(args: TransformerArgs) -> dict[str, tuple[Any, Any, str]]:
    moe = {} if args.moe is None else {
        "model_type": ("mixtral", None, "a sparse model imports the Mixtral layout"),
        "intermediate_size": (args.moe.hidden, None, "--model.moe_hidden"),
        "num_local_experts": (args.moe.n_experts, None, "--model.moe_experts"),
        "num_experts_per_tok": (args.moe.top_k, None, "--model.moe_top_k"),
    }
    return {
        "model_type": ("llama", None, "only Llama (or, for a sparse model, Mixtral) models are imported"),
        "hidden_size": (args.dim, None, "--model.dim"),
        "num_hidden_layers": (args.n_layers, None, "--model.n_layers"),
        "num_attention_heads": (args.n_heads, None, "--model.n_heads"),
        "num_key_value_heads": (args.n_kv_heads, args.n_kv_heads, "--model.n_kv_heads"),
        "intermediate_size": (args.ffn_hidden, None, "--model.ffn_hidden"),
        "vocab_size": (args.vocab_size, None, "--model.vocab_size or --data.tokenizer"),
        "head_dim": (args.head_dim, args.head_dim, "--model.dim / --model.n_heads"),
        "tie_word_embeddings": (args.tie_embeddings, False,
                                f"--model.tie_embeddings {str(not args.tie_embeddings).lower()}"),
        "rope_theta": (args.rope_theta, 10000.0, "--model.rope_theta"),
        "rms_norm_eps": (args.norm_eps, 1e-6, "Stalwart's RMSNorm eps is fixed"),
        "rope_scaling": (None, None, "RoPE scaling is not supported"),
        "hidden_act": ("silu", "silu", "only SiLU (SwiGLU) MLPs are supported"),
        "attention_bias": (False, False, "attention biases are not supported"),
        "mlp_bias": (False, False, "MLP biases are not supported"),
        "sliding_window": (args.sliding_window or None, None, "--model.sliding_window"),
        "stalwart_embed_dim": (args.embed_dim, 0, "--model.embed_dim"),
    } | moe


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)), abs(float(b)))
    return a == b


def check_hf_config(config: dict[str, Any], args: TransformerArgs, where: str = "") -> None:
    """Refuse a Hugging Face model whose config computes another function than this run's model."""
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ExportError(f"checkpoint.init_from_hf {where}: config.json has rope_parameters.rope_type = "
                          f"{params['rope_type']!r}: RoPE scaling is not supported")
    for key, (ours, default, fix) in _hf_expectations(args).items():
        theirs = config.get(key, params.get(key, default) if key == "rope_theta" else default)
        if not _same(theirs, ours):
            raise ExportError(f"checkpoint.init_from_hf {where}: config.json has {key} = {theirs!r}, but this "
                              f"run's model has {ours!r} ({fix})")


def body_of(config: dict[str, Any], args: TransformerArgs) -> TransformerArgs:
    """The shape to read from ``config`` for a model of ``args``: ``args`` itself, or, for an embeddings
    model started from a language model's weights, the language model's (its output head is not read:
    the embeddings head starts from the seed)."""
    if args.embed_dim and not config.get("stalwart_embed_dim"):
        return dataclasses.replace(args, embed_dim=0, tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    return args


def from_hf_state(config: dict[str, Any], tensors: dict[str, torch.Tensor], args: TransformerArgs,
                  where: str = "") -> dict[str, torch.Tensor]:
    """HF tensors -> Stalwart full state dict, after checking the shapes agree with ``args``. An
    embeddings model given a language model gets every tensor but the output head (``body_of``)."""
    body = body_of(config, args)
    if body is not args:
        state = from_hf_state(config, tensors, body, where)
        state.pop("output.weight", None)
        return state
    check_hf_config(config, args, where)
    want, state = model_shapes(args), {}

    def check_shape(name: str, have: tuple[int, ...], ours: str) -> None:
        if have != want[ours]:
            raise ExportError(f"checkpoint.init_from_hf {where}: tensor '{name}' has shape {shape_words(have)}, "
                              f"but config.json describes {shape_words(want[ours])} (the weights are not the "
                              "model config.json describes)")

    for ours, theirs in name_map(args):
        if ".moe.router." in ours:
            theirs = hf_moe.router_from_hf_name(theirs, tensors)
        if theirs not in tensors:
            raise ExportError(f"checkpoint.init_from_hf {where}: tensor '{theirs}' is missing")
        check_shape(theirs, tuple(tensors[theirs].shape), ours)
        t = tensors[theirs].float()
        if ours.endswith("attention.wq.weight"):
            t = from_hf_rope(t, args.n_heads)
        elif ours.endswith("attention.wk.weight"):
            t = from_hf_rope(t, args.n_kv_heads)
        state[ours] = t
    if args.moe is not None:
        experts = hf_moe.experts_from_hf(tensors, args, where)
        for ours, t in experts.items():
            check_shape(f"{ours} (stacked from the HF expert tensors)", tuple(t.shape), ours)
        state.update(experts)
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, args: TransformerArgs, directory: str | Path) -> None:
    """Set a (possibly sharded) model's weights from an HF Llama directory (every rank reads the files)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    check_exportable(args)
    config, tensors = read_hf(directory)
    state = from_hf_state(config, tensors, args, str(directory))
    own = model.state_dict()
    state = {k: v.to(own[k].dtype) for k, v in state.items() if k in own}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
