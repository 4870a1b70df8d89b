"""The mixture-of-experts view of a run: expert x step load per sparse layer, from ``metrics.jsonl``.

Each training record of a sparse model carries ``moe_tokens_per_expert`` (layer -> tokens routed to each
expert that step, summed over ranks); the load of an expert is its count over the layer's mean count
(1.0 = its fair share), which is what the dashboard's heat map colours.
"""

from __future__ import annotations

from typing import Any

SERIES = ("moe_load_imbalance", "moe_load_imbalance_max", "moe_ep_imbalance", "moe_router_entropy", "moe_aux_loss",
          "moe_a2a_s")


def expert_view(records: list[dict[str, Any]], max_steps: int = 200) -> dict[str, Any] | None:
    """``records``: one training record per step, in step order. None for a dense model."""
    rows = [r for r in records if isinstance(r.get("moe_tokens_per_expert"), dict)][-max_steps:]
    if not rows:
        return None
    layers = sorted(rows[-1]["moe_tokens_per_expert"], key=int)
    load: dict[str, list[list[float | None]]] = {}
    for layer in layers:
        n = len(rows[-1]["moe_tokens_per_expert"][layer])
        matrix: list[list[float | None]] = [[] for _ in range(n)]
        for r in rows:
            counts = r["moe_tokens_per_expert"].get(layer)
            mean = sum(counts) / len(counts) if counts else 0.0
            for e in range(n):
                matrix[e].append(counts[e] / mean if counts and mean > 0 else None)
        load[layer] = matrix
    return {"steps": [r["step"] for r in rows], "layers": layers, "load": load,
            "bias": rows[-1].get("moe_expert_bias", {}),
            "series": {k: [[r["step"], r[k]] for r in rows if isinstance(r.get(k), (int, float))] for k in SERIES}}
