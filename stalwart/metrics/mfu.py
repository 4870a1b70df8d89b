"""Peak FLOP/s of the device (for MFU): a table for known GPUs, a measurement on CPU."""

from __future__ import annotations

import time

import torch

# Dense (non-sparse) peak TFLOP/s per GPU.
GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp32": 31.2},
}


def gpu_peak_tflops(name: str, dtype: torch.dtype) -> float | None:
    key = "bf16" if dtype == torch.bfloat16 else "fp32"
    for model, peaks in GPU_PEAK_TFLOPS.items():
        if model in name:
            return peaks[key]
    return None


def measure_matmul_tflops(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.3,
                          device: str = "cpu") -> float:
    """Best-of-runs square matmul throughput with the current thread settings."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(2):
        a @ b
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best / 1e12


def peak_tflops(device: torch.device, dtype: torch.dtype, configured: float) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the number came from)."""
    if configured > 0:
        return configured, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, dtype)
        if peak:
            return peak, f"{name} spec sheet"
        return measure_matmul_tflops(dtype, n=8192, seconds=1.0, device="cuda"), f"measured matmul on {name}"
    return measure_matmul_tflops(dtype), f"measured {dtype} matmul, {torch.get_num_threads()} thread(s)"
