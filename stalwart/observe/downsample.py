"""Largest-Triangle-Three-Buckets downsampling (Steinarsson, 2013): keep the shape of a curve in n points.

Pure numpy. The first and last points are kept; the points between are split into ``n - 2`` buckets
and each bucket keeps the point forming the largest triangle with the point kept before it and the
mean of the next bucket, so spikes (a loss spike, a slow step) survive where striding would drop them.
"""

from __future__ import annotations

import numpy as np


def lttb(x: np.ndarray, y: np.ndarray, n: int) -> np.ndarray:
    """Indices (ascending) of at most ``n`` points of ``(x, y)`` that keep its visual shape."""
    size = len(x)
    if n >= size or n < 3:
        return np.arange(size) if n >= size else np.linspace(0, size - 1, max(n, 1)).round().astype(np.int64)
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    edges = (np.arange(n - 1) * ((size - 2) / (n - 2))).astype(np.int64) + 1  # n - 1 edges of n - 2 buckets
    edges[-1] = size - 1
    out = np.empty(n, dtype=np.int64)
    out[0], out[-1] = 0, size - 1
    a = 0
    for i in range(n - 2):
        lo, hi = edges[i], edges[i + 1]
        nlo, nhi = hi, (edges[i + 2] if i + 2 < n - 1 else size)
        cx, cy = x[nlo:nhi].mean(), y[nlo:nhi].mean()
        area = np.abs((x[a] - cx) * (y[lo:hi] - y[a]) - (x[a] - x[lo:hi]) * (cy - y[a]))
        a = lo + int(area.argmax())
        out[i + 1] = a
    return out


def downsample(x: np.ndarray, y: np.ndarray, n: int) -> tuple[list[float], list[float]]:
    """The finite points of ``(x, y)``, LTTB-downsampled to at most ``n``, as JSON-ready lists."""
    ok = np.isfinite(y)
    x, y = x[ok], y[ok]
    idx = lttb(x, y, n)
    return x[idx].tolist(), y[idx].tolist()
