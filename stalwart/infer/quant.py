"""Quantized weights for serving: int8 linear layers with dynamically quantized activations.

``apply_quantization(model, "int8")`` replaces every linear layer of the decoder blocks, and the output
head, with an :class:`Int8Linear`: its weight in int8 with one scale per output channel (symmetric), its
input quantized to uint8 at each call (one scale and zero point per call, from the input's range), the
product computed in integers and scaled back to float32. The kernels are PyTorch's own quantized
engines: FBGEMM for passes of few tokens (decoding), oneDNN for longer ones (prefill, large batches),
each with its own copy of the packed weight, chosen by the pass's token count.

Why this kernel (measured on a Xeon with AMX, a 125M-shaped chain of linears at one token, 2 threads;
docs/serving.md has the figures): dynamic int8 ran ~2.9x faster than float32 at one token and oneDNN's
~2.6x at 32 tokens, while the weight-only int8 and int4 kernels (``torch._weight_int8pack_mm``,
``torch._weight_int4pack_mm_for_cpu``, ``torch.ops.aten._dyn_quant_matmul_4bit``; bitsandbytes' CPU
4-bit; torchao's PyPI wheel ships no CPU kernels) were 10-80x slower than float32 at one token. So there
is no int4 here: no 4-bit kernel that runs on this CPU beat float32.

NOTE: the activation's scale covers the whole forward pass, so a request's int8 logits depend (in the
last bits of the quantization) on what else is in the pass; tokens are reproducible for the same batch.

The embedding stays in float32 (a lookup reads one row per token); a tied output head gets its own int8
copy. Each quantized layer reports its weight dequantized in ``state_dict`` (the names and shapes of the
float model), and :func:`requantize` takes new float weights (a weight update), so the server's weight
swaps work unchanged.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Literal

import torch
from torch import nn

from stalwart.errors import UserError
from stalwart.runtime.device import HOST

Quantize = Literal["none", "int8"]
QUANTIZE = ("none", "int8")
# Passes of at most this many tokens use FBGEMM's kernel, longer ones oneDNN's (measured crossover).
SMALL_PASS_TOKENS = 8


@contextlib.contextmanager
def _quantized_engine(name: str):
    """``torch.backends.quantized.engine`` set to ``name`` while weights are packed (the packed weight
    remembers its engine; the global setting is restored)."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


class Int8Linear(nn.Module):
    """``y = x W^T``, W in int8 per output channel, x quantized per call. ``weight`` is None: the model's
    fused projections then call each quantized layer on its own (``models/fused.py: plain_weights``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = None
        self.set_weight(weight)

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantize ``weight`` (out, in), any float dtype, and pack it for both kernels."""
        w = weight.detach().float().to(HOST)
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
        with warnings.catch_warnings():  # NOTE: quantized tensors are deprecated in torch (still in 2.13)
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)
        with _quantized_engine("fbgemm"):
            self._small = torch.ops.quantized.linear_prepack(q, None)
        with _quantized_engine("onednn"):
            self._large = torch.ops.quantized.linear_prepack(q, None)
        self._dequantized_shape = tuple(w.shape)
        self._q = q  # kept for state_dict (dequantized there) and the size figures

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._small if x.numel() <= SMALL_PASS_TOKENS * self.in_features else self._large
        return torch.ops.quantized.linear_dynamic(x, packed, False)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self._q.dequantize()

    def nbytes(self) -> int:
        return self._q.numel() + 8 * self.out_features  # int8 weights and one float64 scale per channel

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 dynamic"


def check_quantize(quantize: str, dtype: torch.dtype, device: torch.device, tp: int) -> None:
    """Raise UserError if ``quantize`` cannot serve with these settings."""
    if quantize not in QUANTIZE:
        raise UserError(f"engine.quantize must be one of {', '.join(QUANTIZE)} (got {quantize!r})")
    if quantize == "none":
        return
    if device.type != HOST.type:
        raise UserError(f"engine.quantize = {quantize} runs PyTorch's CPU kernels (FBGEMM, oneDNN): on "
                        f"{device.type} serve with engine.dtype = bfloat16 instead, or run on cpu")
    if dtype != torch.float32:
        raise UserError(f"engine.quantize = {quantize} takes float32 activations: set engine.dtype = float32 "
                        "(the weights are int8 either way)")
    if tp > 1:
        raise UserError(f"engine.quantize = {quantize} needs whole weights in each process: serve it with "
                        "layout.tp = 1 (pipeline stages and replicas work)")
    missing = {"fbgemm", "onednn"} - set(torch.backends.quantized.supported_engines)
    if missing:
        raise UserError(f"engine.quantize = {quantize} needs PyTorch's {' and '.join(sorted(missing))} "
                        "quantized engine, which this build of torch lacks")


def _targets(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of every linear layer in the decoder blocks, and the output head."""
    found = [(parent, name, child) for block in model.layers.values() for parent in block.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    if getattr(model, "output", None) is not None:
        found.append((model, "output", model.output))
    return found


@torch.no_grad()
def apply_quantization(model: nn.Module, quantize: str) -> nn.Module:
    """Replace ``model``'s linear layers (``_targets``) by quantized ones, in place; ``none`` changes
    nothing. The model must be on the CPU in float32 (``check_quantize``)."""
    if quantize == "none":
        return model
    for parent, name, linear in _targets(model):
        if linear.bias is not None:
            raise UserError(f"engine.quantize: layer {name} has a bias, which Stalwart's model never has")
        setattr(parent, name, Int8Linear(linear.weight))
    return model


def requantize(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Quantize the new float weights ``state`` (full state dict) into ``model``'s quantized layers."""
    for name, module in model.named_modules():
        if isinstance(module, Int8Linear):
            module.set_weight(state[f"{name}.weight" if name else "weight"])


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take in memory (quantized layers at their int8 size; a tied tensor once)."""
    seen: dict[int, int] = {}
    for p in list(model.parameters()) + list(model.buffers()):
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values()) + sum(m.nbytes() for m in model.modules() if isinstance(m, Int8Linear))
