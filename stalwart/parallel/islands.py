"""The islands' outer optimization, as pure functions: the schedule, the fragments, the quantized
outer gradient and the outer Nesterov step (``parallelism.islands``; the process side is
``train/islands.py``).

DiLoCo (Douillard et al., 2023): every island takes ``H`` inner steps; the outer gradient of a
parameter is ``anchor - local`` (how far the island moved from the last global value); the islands
average it and apply Nesterov SGD to the anchor, and every island continues from the new anchor.
Streaming DiLoCo (Douillard et al., 2025): the model's blocks in ``P`` fragments; fragment ``f``
launches its exchange at the steps ``n`` with ``n % H == (f + 1) * H / P % H``, keeps training for
``tau`` steps while it travels, and then mixes: ``local = mixing * local + (1 - mixing) * anchor``.
Outer gradients travel in float32, bfloat16, or int8/int4 with one float32 scale per block; what the
rounding lost is added to the next outer gradient (error feedback).

Every reduction sums the islands' contributions in island order, so the result does not depend on
which island computed first or on the transport.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = {"int8": 127, "int4": 7}


@dataclass(frozen=True)
class Sync:
    """One outer sync: ``fragment`` launched after step ``launch``, applied after step ``apply``."""

    index: int
    fragment: int
    launch: int
    apply: int


class Schedule:
    """Which fragment syncs when. ``algorithm`` diloco: one fragment every ``H`` steps, no overlap;
    streaming: ``P`` fragments ``H / P`` steps apart, each applied ``tau`` steps after its launch;
    sync: every step (gradients, not parameters)."""

    def __init__(self, algorithm: str, inner_steps: int, fragments: int, overlap: int) -> None:
        self.algorithm = algorithm
        self.h = 1 if algorithm == "sync" else inner_steps
        self.p = fragments if algorithm == "streaming" else 1
        self.tau = overlap if algorithm == "streaming" else 0
        self.every = self.h // self.p

    def launched_at(self, step: int) -> Sync | None:
        """The sync whose exchange starts after optimizer step ``step`` (1-based), if any."""
        if step <= 0 or step % self.every:
            return None
        k = step // self.every  # the k-th launch, 1-based
        fragment = (k - 1) % self.p
        return Sync(k - 1, fragment, step, step + self.tau)

    def applied_at(self, step: int) -> Sync | None:
        return self.launched_at(step - self.tau) if self.tau else self.launched_at(step)


def fragments_of(names: list[str], n_layers: int, p: int) -> list[int]:
    """Each parameter's fragment: blocks ``layers.i.`` in ``p`` contiguous runs of layers; the
    embedding goes with the first fragment, the final norm and output with the last."""
    out = []
    for name in names:
        parts = name.split(".")
        if "layers" in parts and parts.index("layers") + 1 < len(parts):
            layer = int(parts[parts.index("layers") + 1])
            out.append(min(p - 1, layer * p // max(n_layers, 1)))
        elif "embed" in name or "tok_" in name:
            out.append(0)
        else:
            out.append(p - 1)
    return out


# ------------------------------------------------------------------ quantization
def quantize(x: torch.Tensor, how: str, block: int) -> torch.Tensor:
    """The payload of a flat float32 vector ``x`` as one uint8 tensor (what crosses the link)."""
    if how == "none":
        return x.contiguous().view(torch.uint8)
    if how == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    qmax = QMAX[how]
    n = x.numel()
    pad = (-n) % block
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, block)
    scale = blocks.abs().amax(dim=1) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax - 1, qmax).to(torch.int8).flatten()
    if how == "int4":  # two values a byte: low nibble first
        u = (q + 8).to(torch.uint8)
        u = torch.nn.functional.pad(u, (0, u.numel() % 2))
        q = (u[0::2] | (u[1::2] << 4)).view(torch.int8)
    return torch.cat([scale.contiguous().view(torch.uint8), q.view(torch.uint8)])


def dequantize(payload: torch.Tensor, n: int, how: str, block: int) -> torch.Tensor:
    """The float32 vector a :func:`quantize` payload stands for."""
    if how == "none":
        return payload.view(torch.float32)[:n]
    if how == "bf16":
        return payload.view(torch.bfloat16)[:n].float()
    blocks = -(-n // block)
    scale = payload[:4 * blocks].view(torch.float32)
    body = payload[4 * blocks:]
    if how == "int4":
        low = (body & 0x0F).to(torch.int16) - 8
        high = (body >> 4).to(torch.int16) - 8
        q = torch.stack([low, high], dim=1).flatten()[:blocks * block].float()
    else:
        q = body.view(torch.int8).float()
    return (q.view(blocks, block) * scale[:, None]).flatten()[:n]


def average(payloads: list[torch.Tensor], n: int, how: str, block: int) -> torch.Tensor:
    """The islands' mean outer gradient, summed in island order."""
    total = dequantize(payloads[0], n, how, block).clone()
    for p in payloads[1:]:
        total += dequantize(p, n, how, block)
    return total / len(payloads)


def nesterov(anchor: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, lr: float, mu: float) -> None:
    """Outer Nesterov SGD on the anchor, in place (torch.optim.SGD's nesterov form)."""
    momentum.mul_(mu).add_(grad)
    anchor.sub_(grad.add(momentum, alpha=mu), alpha=lr)
