"""Load a model for inference: from a run's checkpoint (any training layout) or a Hugging Face directory.

Every rank reads the full weights (the checkpoint reader reshards whatever layout trained them), then
keeps its tensor-parallel shard: the model is split with the same plan module the trainer uses
(``parallel/tensor.py``), in its replicated-stream form.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from stalwart.errors import UserError
from stalwart.models.flavors import TransformerArgs
from stalwart.models.llama import Transformer


@dataclass
class Source:
    """Where weights come from: a run directory (optionally one checkpoint) or an HF directory."""

    run: Path | None = None
    checkpoint: str | None = None
    hf: Path | None = None

    @property
    def name(self) -> str:
        return (self.run or self.hf).resolve().name


@dataclass
class Loaded:
    args: TransformerArgs
    tokenizer: object  # tokenizers.Tokenizer
    eos_id: int | None
    state: dict[str, torch.Tensor]  # full, unsharded
    origin: Path  # the checkpoint or HF directory read


def read_source(src: Source) -> Loaded:
    if src.hf is not None:
        return _read_hf(src.hf)
    from stalwart.checkpoint.run_checkpoint import load_run_model
    from stalwart.data.tokenizer import eos_id

    model, tok, _, path = load_run_model(src.run, src.checkpoint)
    return Loaded(model.args, tok, eos_id(tok), dict(model.state_dict()), path)


def _read_hf(directory: Path) -> Loaded:
    from tokenizers import Tokenizer

    from stalwart.export.hf import args_from_hf, from_hf_state, read_hf

    where = f"--hf {directory}"
    if not (directory / "tokenizer.json").is_file():
        raise UserError(f"{where}: no tokenizer.json (export the model with `stalwart export --format hf`)")
    config, tensors = read_hf(directory)
    args = args_from_hf(config, where)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return Loaded(args, tok, eos, from_hf_state(config, tensors, args, where), directory)


def read_args(src: Source) -> TransformerArgs:
    """The model shape alone (config files only; no weights read), to check a layout before launching."""
    if src.hf is not None:
        from stalwart.export.hf import args_from_hf, read_config

        return args_from_hf(read_config(src.hf, "--hf"), f"--hf {src.hf}")
    from stalwart.checkpoint.run_checkpoint import open_run_checkpoint

    return open_run_checkpoint(src.run, src.checkpoint).args


def check_layout(a: TransformerArgs, tp: int, pp: int) -> None:
    if a.n_kv_heads % tp or a.n_heads % tp:
        raise UserError(f"--tp {tp} must divide the model's attention heads ({a.n_heads}) and key/value heads "
                        f"({a.n_kv_heads})")
    if pp > a.n_layers:
        raise UserError(f"--pp {pp} exceeds the model's {a.n_layers} layers")


def build_model(loaded: Loaded, dtype: torch.dtype, device: torch.device, tp_mesh=None, stage: int = 0,
                stages: int = 1, quantize: str = "none") -> nn.Module:
    """The model with the loaded weights, in ``dtype`` on ``device``: pipeline stage ``stage`` of
    ``stages`` (the trainer's split), its heads and MLP units split over ``tp_mesh`` (a mesh on
    ``device``'s type) if given, its linear layers quantized as ``quantize`` says (``infer/quant.py``)."""
    from stalwart.infer.quant import apply_quantization, check_quantize

    check_quantize(quantize, dtype, device, tp_mesh.size() if tp_mesh is not None else 1)
    model = layout_model(loaded.args, device, tp_mesh, stage, stages)
    copy_full_state(model, loaded.state)
    model.to(dtype)
    return apply_quantization(model, quantize).eval()


def layout_model(a: TransformerArgs, device: torch.device, tp_mesh=None, stage: int = 0, stages: int = 1) -> nn.Module:
    """The model of ``a`` on ``device`` laid out as :func:`build_model` lays it out (weights to be copied
    in: an RL generator's arrive from its trainers)."""
    tp = tp_mesh.size() if tp_mesh is not None else 1
    check_layout(a, tp, stages)
    model = Transformer(a)
    if stages > 1:
        from stalwart.parallel.pipeline import split_model

        model = split_model(model, stage, stages, "1f1b", 1).container
    if tp_mesh is not None:
        from stalwart.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, tp_mesh, loss_parallel=False, sequence_parallel=False)
    return model.to(device)  # what tensor parallelism did not already place on its mesh's device


def _shard_shape(param: torch.Tensor) -> tuple[int, ...]:
    """This rank's shard's shape of a tensor-parallel parameter (its whole shape otherwise)."""
    from torch.distributed.tensor import DTensor

    return tuple(param.to_local().shape) if isinstance(param, DTensor) else tuple(param.shape)


def check_full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise UserError unless ``state`` has every tensor of ``model`` in its full (unsharded) shape, or
    already cut to this tensor-parallel rank's shard (an RL generator's weight sync sends each rank its own)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise UserError(f"the weights have no tensor {missing[0]!r} ({len(missing)} missing)")
    for name, param in own.items():
        if tuple(state[name].shape) not in (tuple(param.shape), _shard_shape(param)):
            raise UserError(f"weight {name!r} has shape {tuple(state[name].shape)}, the model expects "
                            f"{tuple(param.shape)}")


@torch.no_grad()
def copy_full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a model's parameters, keeping each tensor-parallel rank's shard only (a
    tensor already of the shard's shape, not the full one, is that shard); quantized layers quantize
    theirs again."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from stalwart.infer.quant import requantize

    check_full_state(model, state)  # everything before changing anything
    own = model.state_dict()  # a quantized layer's entry is a dequantized copy: requantize sets it
    requantize(model, state)
    for name, param in own.items():
        full = state[name]
        if isinstance(param, DTensor) and tuple(full.shape) != tuple(param.shape):
            param.to_local().copy_(full.to(param.dtype))
        elif isinstance(param, DTensor):
            local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                                      src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full.to(param.dtype))


def source_from(where: str | Path) -> Source:
    """A weight source named by one path: an HF directory, a run directory, or one of its checkpoints."""
    p = Path(where)
    if (p / "config.json").is_file():
        return Source(hf=p)
    if (p / "config.toml").is_file():
        return Source(run=p)
    if p.parent.name == "checkpoints" and (p.parent.parent / "config.toml").is_file():
        return Source(run=p.parent.parent, checkpoint=str(p))
    raise UserError(f"{where} is neither a run directory, one of its checkpoints, nor a Hugging Face directory")


def save_hf(state: dict[str, torch.Tensor], args: TransformerArgs, tokenizer, eos_id: int | None, out: Path) -> None:
    """Write full weights ``state`` with their ``tokenizer`` (a tokenizers.Tokenizer) as a Hugging Face
    directory ``out`` that ``read_source`` reads back (a served model's weights kept on disk)."""
    import tempfile

    from stalwart.export.hf import export_hf

    eos = tokenizer.id_to_token(eos_id) if eos_id is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_json = Path(tmp) / "tokenizer.json"
        tokenizer.save(str(tokenizer_json))
        export_hf(state, args, tokenizer_json, eos, eos_id, out)
