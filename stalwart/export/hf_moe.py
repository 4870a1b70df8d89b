"""Hugging Face Mixtral layout for a mixture-of-experts model (what ``hf.py`` adds for sparse layers).

Mixtral routes like Stalwart's softmax router: softmax over all experts, top-k, weights renormalised to
sum to 1, no shared experts, every layer sparse. Attention, norms and embeddings are Llama's. Experts are
written in the Hub's per-expert layout (``block_sparse_moe.experts.<e>.w1.weight``, which ``transformers``
fuses on load); import reads that layout or the fused one ``transformers`` keeps in memory
(``mlp.experts.gate_up_proj`` / ``down_proj``).

Stalwart stacks expert weights for ``x @ w``: w1, w3 (experts, dim, hidden), w2 (experts, hidden, dim);
HF stores ``nn.Linear`` weights, the transposes.
"""

from __future__ import annotations

from typing import Any

import torch

from stalwart.errors import UserError
from stalwart.models.flavors import TransformerArgs


class MoEExportError(UserError):
    pass


def check_mixtral(args: TransformerArgs) -> None:
    """The shapes Mixtral can express; anything else would change the function, so it is refused."""
    m = args.moe
    problems = []
    if m.n_dense_layers:
        problems.append(f"model.moe_dense_layers = {m.n_dense_layers} (Mixtral has no dense layers)")
    if m.n_shared:
        problems.append(f"model.moe_shared = {m.n_shared} (Mixtral has no shared experts)")
    if m.score_func != "softmax" or not m.route_norm or m.route_scale != 1.0:
        problems.append("a sigmoid or unnormalised/scaled router (Mixtral: softmax, top-k renormalised)")
    if problems:
        raise MoEExportError("cannot export to the Hugging Face Mixtral layout: " + "; ".join(problems))


def router_names(i: int) -> list[tuple[str, str]]:
    return [(f"layers.{i}.moe.router.gate.weight", f"model.layers.{i}.block_sparse_moe.gate.weight")]


def mixtral_config(args: TransformerArgs, llama: dict[str, Any]) -> dict[str, Any]:
    m = args.moe
    return {**llama, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": m.hidden, "num_local_experts": m.n_experts, "num_experts_per_tok": m.top_k,
            "router_aux_loss_coef": m.aux_loss_coef, "output_router_logits": False, "router_jitter_noise": 0.0,
            "sliding_window": None}


def experts_to_hf(state: dict[str, torch.Tensor], args: TransformerArgs) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors of every sparse layer. Refuses a non-zero routing bias (Mixtral has none,
    so the exported model would route differently)."""
    out = {}
    for i in range(args.n_layers):
        p, q = f"layers.{i}.moe.", f"model.layers.{i}.block_sparse_moe.experts."
        bias = state.get(p + "router.expert_bias")
        if bias is not None and bool(bias.ne(0).any()):
            raise MoEExportError(f"cannot export to the Hugging Face Mixtral layout: layer {i} routes with a "
                                 "non-zero balancing bias (model.moe_bias_rate > 0), which Mixtral cannot express")
        for ours in ("w1", "w2", "w3"):
            if p + f"experts.{ours}" not in state:
                raise MoEExportError(f"checkpoint has no tensor '{p}experts.{ours}'")
            stacked = state[p + f"experts.{ours}"].detach().cpu()
            for e in range(args.moe.n_experts):
                out[f"{q}{e}.{ours}.weight"] = stacked[e].t().contiguous().clone()
    return out


def experts_from_hf(tensors: dict[str, torch.Tensor], args: TransformerArgs, where: str) -> dict[str, torch.Tensor]:
    """Stacked Stalwart expert weights of every sparse layer, from either HF layout."""
    state = {}
    n = args.moe.n_experts
    for i in range(args.n_layers):
        p, hub, fused = f"layers.{i}.moe.experts.", f"model.layers.{i}.block_sparse_moe.experts.", \
            f"model.layers.{i}.mlp.experts."
        if fused + "gate_up_proj" in tensors:
            gate_up, down = tensors[fused + "gate_up_proj"].float(), tensors[fused + "down_proj"].float()
            w1, w3 = gate_up.chunk(2, dim=1)  # (experts, hidden, dim) each
            state[p + "w1"], state[p + "w3"] = w1.transpose(1, 2), w3.transpose(1, 2)
            state[p + "w2"] = down.transpose(1, 2)
            continue
        for ours in ("w1", "w2", "w3"):
            names = [f"{hub}{e}.{ours}.weight" for e in range(n)]
            missing = [x for x in names if x not in tensors]
            if missing:
                raise MoEExportError(f"checkpoint.init_from_hf {where}: tensor '{missing[0]}' is missing")
            state[p + ours] = torch.stack([tensors[x].float().t() for x in names])
    return {k: v.contiguous() for k, v in state.items()}


def router_from_hf_name(theirs: str, tensors: dict[str, torch.Tensor]) -> str:
    """The router's HF name as stored (Hub layout) or as ``transformers`` names it in memory."""
    if theirs in tensors:
        return theirs
    return theirs.replace(".block_sparse_moe.gate.weight", ".mlp.gate.weight")
