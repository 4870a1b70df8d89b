"""Calibrate the step-time model on published throughput and report its error on every row.

The one constant fitted is each GPU generation's GEMM efficiency (``GPUSpec.gemm_efficiency``): the
value minimising the squared log error over that generation's ``fit`` rows of ``published.py``
(golden-section search; the error is unimodal in it). The other constants of ``cost.py`` stay as
they are. ``held_out`` rows never enter the fit: their error is the model's error on unseen points.
"""

from __future__ import annotations

import dataclasses
import math

from stalwart.planner.cost import Network, Options
from stalwart.planner.hardware import GPUS
from stalwart.planner.layout import Workload
from stalwart.planner.published import ROWS, Row
from stalwart.planner.search import Candidate, Space, rank_layouts
from stalwart.planner.shapes import FLAVORS, ModelShape

GENERATIONS = {"ampere": ("A100",), "hopper": ("H100", "H200", "H100-96G")}


def shape_of(row: Row) -> ModelShape:
    if row.flavor:
        return FLAVORS[row.flavor]
    dim, layers, heads, kv, ffn, vocab = row.shape
    return ModelShape(dim, layers, heads, kv, ffn, vocab, tie_embeddings=row.tie_embeddings)


def predict(row: Row, gemm_efficiency: float = 0.0) -> Candidate:
    """The planner's best layout for ``row`` (its stated degrees pinned, the rest chosen)."""
    w = Workload(shape_of(row), row.seq_len, row.global_batch)
    net = Network(nic_gbps=row.nic_gbps, pod_gpus=row.pod_gpus, spine_oversubscription=row.spine_oversubscription)
    opt = Options(power_limit_w=row.power_limit_w, gemm_efficiency=gemm_efficiency)
    space = Space(tp=(row.tp,), pp=(row.pp,), cp=(row.cp,), micro_batch=row.micro_batch, ac=row.ac, fsdp=row.fsdp,
                  schedules=row.schedules if row.pp > 1 else ("1f1b",))
    ranked = rank_layouts(w, row.gpus, GPUS[row.gpu], net, opt, space=space)
    if not ranked:
        raise ValueError(f"{row.name}: no valid layout for the published degrees")
    return ranked[0]


def megatron_flops_per_step(row: Row) -> float:
    """Megatron-LM's FLOPs per iteration: 96 B s l h^2 (1 + s / 6h + V / 16 l h) (recomputation counted)."""
    h, layers, _, _, _, vocab = row.shape
    b, s = row.global_batch, row.seq_len
    return 96.0 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def predicted_value(row: Row, c: Candidate) -> float:
    """The row's metric from the planner's prediction."""
    if row.metric == "megatron_tflops":
        return megatron_flops_per_step(row) / (c.time.step_s * row.gpus) / 1e12
    return getattr(c.time, row.metric)


def error(row: Row, gemm_efficiency: float = 0.0) -> float:
    return predicted_value(row, predict(row, gemm_efficiency)) / row.published - 1.0


def fit(rows: tuple[Row, ...] = ROWS, low: float = 0.3, high: float = 0.95, tol: float = 1e-3) -> dict[str, float]:
    """{generation: GEMM efficiency} minimising the squared log error over its ``fit`` rows."""
    out = {}
    for gen, gpus in GENERATIONS.items():
        mine = [r for r in rows if r.role == "fit" and r.gpu in gpus]
        if not mine:
            continue

        def loss(e: float) -> float:
            return sum(math.log1p(error(r, e)) ** 2 for r in mine)

        a, b = low, high
        g = (math.sqrt(5) - 1) / 2
        c, d = b - g * (b - a), a + g * (b - a)
        fc, fd = loss(c), loss(d)
        while b - a > tol:
            if fc < fd:
                b, d, fd = d, c, fc
                c = b - g * (b - a)
                fc = loss(c)
            else:
                a, c, fc = c, d, fd
                d = a + g * (b - a)
                fd = loss(d)
        out[gen] = round((a + b) / 2, 3)
    return out


def report(rows: tuple[Row, ...] = ROWS) -> list[dict]:
    """Every row with its prediction under the shipped constants: role, published, predicted, error."""
    out = []
    for r in rows:
        c = predict(r)
        value = predicted_value(r, c)
        out.append({"name": r.name, "source": r.source, "role": r.role, "metric": r.metric, "published": r.published,
                    "predicted": value, "error": value / r.published - 1.0, "reported_error": r.error,
                    "fits": c.fits, "layout": c.layout.describe()})
    return out


def summary(rows: list[dict]) -> dict[str, float]:
    """Largest and mean absolute error of the fitted and the held-out rows."""
    out = {}
    for role in ("fit", "held_out"):
        errs = [abs(r["error"]) for r in rows if r["role"] == role]
        out[f"{role}_max"] = max(errs)
        out[f"{role}_mean"] = sum(errs) / len(errs)
    return out


def with_errors(rows: tuple[Row, ...] = ROWS) -> tuple[Row, ...]:
    """The rows with ``error`` set to what the shipped constants give (to write back into published.py)."""
    return tuple(dataclasses.replace(r, error=round(e["error"], 3)) for r, e in zip(rows, report(rows)))
