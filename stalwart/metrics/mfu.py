"""Peak FLOP/s of the device for MFU, and which precision ``training.dtype = auto`` runs in.

MFU is model FLOP/s over the peak of the precision that actually ran. The peak comes from, in order:
the configured ``metrics.peak_tflops``; a GPU's spec sheet; otherwise a square-matmul measurement
in that precision with the current thread count, cached per machine (CPU model or device name, torch
version, threads) in ``~/.cache/stalwart/matmul_peaks.json`` (``$XDG_CACHE_HOME`` respected), so it
is measured once per machine rather than at every start (again when the machine is quieter than it was
then: ``matmul_peak``). Every peak says where it came from:
"configured", "spec sheet", "measured now" or "cached".
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stalwart.atomic import write_text_atomic
from stalwart.runtime.device import HOST, accelerator_name, is_accelerator, synchronize

# Dense (non-sparse) peak TFLOP/s per GPU.
GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp32": 31.2},
}

# `dtype = auto` picks bf16 only where its matmul peak is at least this multiple of fp32's: below it,
# the casts and the fp32 elementwise work eat the gain and mixed precision is not worth its numerics.
AUTO_BF16_MIN_SPEEDUP = 1.5

_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Peak:
    tflops: float
    source: str  # "configured" | "spec sheet" | "measured now" | "cached"
    detail: str  # what was measured or looked up, for the banner

    def describe(self) -> str:
        return f"{self.source}: {self.detail}" if self.detail else self.source


def gpu_peak_tflops(name: str, dtype: torch.dtype) -> float | None:
    key = _KEYS.get(dtype, "fp32")
    for model, peaks in GPU_PEAK_TFLOPS.items():
        if model in name:
            return peaks[key]
    return None


def measure_matmul_tflops(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.3,
                          device: torch.device | str = HOST) -> float:
    """Best-of-runs matmul throughput with the current thread settings: the better of a square
    ``a @ b`` and a linear layer's ``x @ w.T`` (on some CPUs a dtype's kernels differ per form, and
    a model's linears must not beat the "peak")."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    x = torch.randn(2 * n, n, dtype=dtype, device=device)
    forms = [(lambda: a @ b, 2 * n**3), (lambda: torch.nn.functional.linear(x, b), 4 * n**3)]
    best = 0.0
    for run, flops in forms:
        run()
        deadline = time.perf_counter() + seconds / len(forms)
        while True:
            t0 = time.perf_counter()
            run()
            synchronize(device)
            now = time.perf_counter()
            best = max(best, flops / (now - t0))
            if now >= deadline:
                break
    return best / 1e12


def choose_auto_dtype(fp32_tflops: float, bf16_tflops: float) -> tuple[torch.dtype, str]:
    """What ``dtype = auto`` runs in, from the two matmul peaks, and why (pure)."""
    ratio = bf16_tflops / fp32_tflops if fp32_tflops > 0 else 0.0
    if ratio >= AUTO_BF16_MIN_SPEEDUP:
        return torch.bfloat16, (f"auto: bfloat16, its matmul peak is {ratio:.2f}x float32's "
                                f"(>= {AUTO_BF16_MIN_SPEEDUP}x)")
    return torch.float32, (f"auto: float32, bfloat16 matmul is {ratio:.2f}x float32's here (bfloat16 needs "
                           f">= {AUTO_BF16_MIN_SPEEDUP}x to be worth it)")


def device_name(device: torch.device) -> str:
    if is_accelerator(device):
        return accelerator_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or HOST.type


def cache_key(device: torch.device, dtype: torch.dtype) -> str:
    threads = 0 if is_accelerator(device) else torch.get_num_threads()
    return f"{device_name(device)}|torch {torch.__version__}|{threads} threads|{_KEYS.get(dtype, str(dtype))}"


def peak_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stalwart" / "matmul_peaks.json"


class PeakCache:
    """Measured matmul peaks of this machine, one JSON file shared by every run (best effort: a cache
    that cannot be read or written only means measuring again)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else peak_cache_path()

    def load(self) -> dict[str, float]:
        try:
            data = json.loads(self.path.read_text())
            return {k: float(v) for k, v in data.items()} if isinstance(data, dict) else {}
        except (OSError, ValueError, TypeError):
            return {}

    def store(self, key: str, tflops: float, extra: dict[str, float] | None = None) -> None:
        """Record ``key``'s figure, and ``extra`` entries beside it (a peak's load average)."""
        data = self.load()
        data[key] = tflops
        data.update(extra or {})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps(data, indent=1, sort_keys=True), durable=False)
        except Exception:  # a read-only home: measure again next time
            pass


def matmul_peak(device: torch.device, dtype: torch.dtype, cache: PeakCache | None = None) -> Peak:
    """The measured (or cached) matmul peak of one device in ``dtype``.

    A CPU's peak is cached with the load average it was measured at; a later run on a machine quieter by
    more than ``REMEASURE_LOAD_DROP`` measures again and keeps the better figure: a peak taken while other
    jobs shared the cores understates the machine (here 81 GFLOP/s cached under load, 147-160 quiet) and
    would overstate every MFU computed from it."""
    cache = cache if cache is not None else PeakCache()
    key = cache_key(device, dtype)
    what = f"{_KEYS.get(dtype, dtype)} matmul on {key.split('|')[0]}" + (
        "" if is_accelerator(device) else f", {torch.get_num_threads()} thread(s)")
    data = cache.load()
    cached = data.get(key)
    load = 0.0 if is_accelerator(device) else load_average()
    if cached and load > data.get(f"{key}|load", math.inf) - REMEASURE_LOAD_DROP:
        return Peak(cached, "cached", f"{what}, {cache.path}")
    if is_accelerator(device):
        tflops = measure_matmul_tflops(dtype, n=8192, seconds=1.0, device=device)
    else:
        tflops = measure_matmul_tflops(dtype, n=1024 if dtype == torch.float32 else 512, seconds=0.4)
    cache.store(key, max(tflops, cached or 0.0), None if is_accelerator(device) else {f"{key}|load": load})
    if cached and cached > tflops:
        return Peak(cached, "cached", f"{what}, {cache.path} (measured again, {tflops:.3f} TFLOP/s now)")
    return Peak(tflops, "measured now", what)


# A cached CPU peak is measured again when the 1-minute load average is lower than when it was measured
# by more than this (runnable processes).
REMEASURE_LOAD_DROP = 1.0


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def resolve_dtype(requested: str, device: torch.device, cache: PeakCache | None = None) -> tuple[torch.dtype, str]:
    """The compute dtype of ``training.dtype`` on ``device``, and the reason (shown in the banner)."""
    if requested == "float32":
        return torch.float32, "float32 (configured)"
    if requested == "bfloat16":
        return torch.bfloat16, "bfloat16 (configured)"
    if is_accelerator(device):
        fp32, bf16 = (gpu_peak_tflops(device_name(device), d) for d in (torch.float32, torch.bfloat16))
        if fp32 and bf16:
            return choose_auto_dtype(fp32, bf16)
    fp32, bf16 = (matmul_peak(device, d, cache).tflops for d in (torch.float32, torch.bfloat16))
    return choose_auto_dtype(fp32, bf16)


def peak_tflops(device: torch.device, dtype: torch.dtype, configured: float, cache: PeakCache | None = None) -> Peak:
    """Peak TFLOP/s of one device in the precision that runs, and where the number came from."""
    if configured > 0:
        return Peak(configured, "configured", "metrics.peak_tflops")
    if is_accelerator(device):
        name = device_name(device)
        peak = gpu_peak_tflops(name, dtype)
        if peak:
            return Peak(peak, "spec sheet", f"{name} {_KEYS.get(dtype, dtype)}")
    return matmul_peak(device, dtype, cache)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_device: float, devices: int) -> float:
    """Model FLOP/s utilisation: achieved model FLOP/s over the summed peak of the devices."""
    return tokens_per_s * flops_per_token / (peak_flops_per_device * devices)
