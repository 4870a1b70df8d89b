"""Accelerator and network specifications (vendor datasheets; dense, i.e. non-sparse, FLOP/s)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_tflops: float      # dense peak at boost clock
    hbm_gb: float           # usable HBM, GB (1e9 bytes)
    hbm_tbps: float         # HBM bandwidth, TB/s
    nvlink_gbps: float      # NVLink bandwidth per GPU per direction, GB/s
    sms: int                # streaming multiprocessors (GEMM wave quantisation)
    tdp_w: float            # board power the peak is specified at
    gemm_efficiency: float  # fitted: the share of the peak large GEMMs sustain in training (planner/calibration.py)


# Fitted on the published rows marked "fit" (planner/published.py, planner/calibration.py): Hopper's
# datasheet peak is further from what its GEMMs sustain at training clocks than Ampere's.
HOPPER_GEMM = 0.621
AMPERE_GEMM = 0.556

GPUS: dict[str, GPUSpec] = {
    "H100": GPUSpec("H100 SXM5 80GB", 989.0, 80.0, 3.35, 450.0, 132, 700.0, HOPPER_GEMM),
    "H200": GPUSpec("H200 SXM5 141GB", 989.0, 141.0, 4.8, 450.0, 132, 700.0, HOPPER_GEMM),
    "A100": GPUSpec("A100 SXM4 80GB", 312.0, 80.0, 2.04, 300.0, 108, 400.0, AMPERE_GEMM),
    # The H100 variant of Meta's Grand Teton hosts that torchtitan benchmarks on (HBM2e, 2.4 TB/s).
    "H100-96G": GPUSpec("H100 96GB HBM2e", 989.0, 96.0, 2.4, 450.0, 132, 700.0, HOPPER_GEMM),
}


# Share of board power that does not scale with the core clock (leakage, HBM, board): ~30%.
STATIC_POWER_FRACTION = 0.3


def clock_factor(spec: GPUSpec, power_limit_w: float) -> float:
    """Sustained core clock under a power cap, relative to the spec. Dynamic power ~ f * V^2 with
    V ~ f near the top of the DVFS curve, so f ~ (dynamic power)^(1/3); the static share does not
    shrink. 1.0 when uncapped (0) or capped at/above TDP."""
    if power_limit_w <= 0 or power_limit_w >= spec.tdp_w:
        return 1.0
    static = STATIC_POWER_FRACTION * spec.tdp_w
    return max((power_limit_w - static) / (spec.tdp_w - static), 0.05) ** (1.0 / 3.0)
